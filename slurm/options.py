"""Checks of the values a user gives `python -m slurm`, before anything is rendered: each failure is one line that
names the option, the value and what would work (the CLI prints it and exits with code 2).

Values that Slurm parses itself (the time limit, partition and account names, dependencies) must have Slurm's
syntax; free text (job names, paths, --set values, container images) may hold any printable character, since the
rendered script quotes it, but never a line break (a `#SBATCH` line and the script's comments are one line each)."""
from __future__ import annotations

import re


class OptionError(ValueError):
    """A value the job cannot be rendered with."""

    def __init__(self, option: str, value, hint: str):
        super().__init__(f"{option} {value!r}: {hint}")


_TIME_FORMS = "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS (e.g. 30, 4:00:00, 2-00:00:00)"
_TIME = re.compile(r"^(?:(?P<d>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?"
                   r"|(?P<h>\d+):(?P<hm>\d+):(?P<hs>\d+)|(?P<m>\d+)(?::(?P<ms>\d+))?)$")
_NAME = re.compile(r"^[A-Za-z0-9_.+-]+$")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SET_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)+$")
_DEP_TYPES = "after|afterany|afterok|afternotok|aftercorr|afterburstbuffer"
_DEP_ONE = rf"(?:singleton|(?:{_DEP_TYPES})(?::\d+(?:_\d+)?(?:\+\d+)?)+)"
_DEPENDENCY = re.compile(rf"^{_DEP_ONE}(?:[,?]{_DEP_ONE})*$")


def time_seconds(value: str) -> int:
    """Slurm's --time syntax -> seconds; a limit is required (the job saves and requeues before it)."""
    m = _TIME.match(value.strip()) if isinstance(value, str) else None
    if not m:
        raise OptionError("--time", value, f"not a Slurm time limit; use {_TIME_FORMS}")
    g = {k: int(v) if v else 0 for k, v in m.groupdict().items()}
    seconds = (g["d"] * 86400 + g["dh"] * 3600 + g["dm"] * 60 + g["ds"] + g["h"] * 3600 + g["hm"] * 60 + g["hs"]
               + g["m"] * 60 + g["ms"])
    if seconds <= 0:
        raise OptionError("--time", value, "must be a positive limit (Slurm reads 0 as no limit, but the job needs "
                                           "an end time to save and requeue before)")
    return seconds


def text(option: str, value: str, allow_empty: bool = False) -> str:
    """Free text that the script quotes: anything but control characters (line breaks above all)."""
    if not isinstance(value, str) or (not value and not allow_empty):
        raise OptionError(option, value, "must not be empty")
    bad = sorted({c for c in value if ord(c) < 32 or ord(c) == 127})
    if bad:
        raise OptionError(option, value, f"contains control characters {bad}; use printable characters only")
    return value


def job_name(value: str) -> str:
    text("--job-name", value)
    if "/" in value or value in (".", "..") or "\\" in value:
        raise OptionError("--job-name", value, "names the run's folder: no '/' or '\\' and not '.' or '..'")
    if len(value) > 200:
        raise OptionError("--job-name", value, "is longer than 200 characters")
    return value


def path(option: str, value: str) -> str:
    """A path that also appears in a Slurm file-name pattern (--output): a backslash would switch the patterns off."""
    text(option, value)
    if "\\" in value:
        raise OptionError(option, value, "contains a backslash, which Slurm's file-name patterns treat specially; "
                                         "choose a path without one")
    return value


def slurm_name(option: str, value: str | None, allow_list: bool = False) -> str | None:
    """Partition and account names as Slurm spells them (letters, digits, _ . + -), a comma list for partitions."""
    if value is None:
        return None
    parts = value.split(",") if allow_list else [value]
    if not value or not all(_NAME.match(p) for p in parts):
        what = "comma-separated names" if allow_list else "a name"
        raise OptionError(option, value, f"must be {what} of letters, digits, '_', '.', '+' or '-' (as `sinfo` or "
                                         "`sacctmgr show assoc` print them)")
    return value


def slurm_time(seconds: int) -> str:
    """A --time limit of at least `seconds`, in whole minutes: H:MM:00, or D-HH:MM:00 from a day on."""
    minutes = -(-seconds // 60)
    days, hours, mins = minutes // 1440, minutes // 60 % 24, minutes % 60
    return f"{days}-{hours:02d}:{mins:02d}:00" if days else f"{hours}:{mins:02d}:00"


def dependency(value: str | None) -> str | None:
    if value is None:
        return None
    if not _DEPENDENCY.match(value):
        raise OptionError("--dependency", value, "not a Slurm dependency; use e.g. afterany:12345, afterok:12345:12346 "
                                                 "or singleton")
    return value


def positive(option: str, value: int, maximum: int | None = None) -> int:
    if value < 1 or (maximum is not None and value > maximum):
        limit = f" and <= {maximum}" if maximum is not None else ""
        raise OptionError(option, value, f"must be >= 1{limit}")
    return value


def override(value: str) -> str:
    """A `--set key=value` for megaloop: a dotted key and any one-line value."""
    text("--set", value)
    key, eq, _ = value.partition("=")
    if not eq or not _SET_KEY.match(key):
        raise OptionError("--set", value, "must be section.key=value, e.g. train.steps=1000 or model.mu_rec=8")
    return value


def env_assignment(value: str) -> tuple[str, str]:
    text("--env", value)
    key, eq, val = value.partition("=")
    if not eq or not _ENV_KEY.match(key):
        raise OptionError("--env", value, "must be NAME=VALUE with NAME a shell variable name, e.g. "
                                          "NCCL_SOCKET_IFNAME=ib0")
    return key, val


def set_keys(overrides: list[str]) -> dict[str, str]:
    """key -> value of the --set overrides (the last one of a key wins, as in megaloop)."""
    return dict(o.split("=", 1) for o in overrides)
