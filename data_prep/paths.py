"""Local path options refuse URLs: `--output s3://bucket/x` would otherwise write a folder named `s3:` here and
report success. One argparse type for every command's local path options (data_prep, checkpoints, megaloop)."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(value: str) -> bool:
    """True for scheme://... (s3://, https://, gs://, file://, ...)."""
    return bool(_URL.match(str(value)))


def local_path_error(value: str, remote_option: str | None = None) -> str | None:
    """What is wrong when a URL is given where a local path is expected (None when `value` is not a URL), to follow
    the option's name."""
    if not is_url(value):
        return None
    where = (f"; to write to {value}, give it to {remote_option}" if remote_option
             else "; give a directory on this machine or on a shared file system")
    return f"takes a local path, not the URL {value}{where}"


class LocalPath:
    """argparse `type=` for a local path option: a URL is an argparse error (exit 2) naming `remote_option`, the
    option that takes URLs, where there is one. `as_path`: return a pathlib.Path instead of the string."""

    def __init__(self, remote_option: str | None = None, as_path: bool = False):
        self.remote_option, self.as_path = remote_option, as_path
        self.__name__ = "local path"  # argparse names the type in its messages

    def __call__(self, value: str):
        problem = local_path_error(value, self.remote_option)
        if problem is not None:
            raise argparse.ArgumentTypeError(problem)
        return Path(value) if self.as_path else value
