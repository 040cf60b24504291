"""Config errors that name the field, the value and what is allowed."""
from __future__ import annotations

import difflib
from typing import Iterable


class ConfigError(ValueError):
    """A bad config value; the message says which field, what it was and what would be valid."""

    def __init__(self, field: str, value, allowed: str):
        self.field = field
        self.value = value
        super().__init__(f"config error: {field}={value!r}: {allowed}")


class ConfigFileError(ConfigError):
    """A config file that cannot be used as a whole (a directory, empty, malformed YAML); names the file."""

    def __init__(self, path, problem: str):
        self.field, self.value = str(path), None
        ValueError.__init__(self, f"config error: {path}: {problem}")


def check_choice(field: str, value, choices: Iterable[str]) -> None:
    choices = tuple(choices)
    if value not in choices:
        raise ConfigError(field, value, f"allowed values: {', '.join(choices)}")


def suggest(name: str, candidates: Iterable[str]) -> str:
    """' (did you mean X?)' for the closest candidate, or '' when none is close."""
    close = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
