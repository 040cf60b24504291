"""YAML + `a.b=value` overrides -> a typed, validated Config. Unknown keys and wrong types fail with the field name."""
from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path

import yaml

from megaloop.config.budget import check_one_length, merge_lengths, resolve_steps
from megaloop.config.errors import ConfigError, ConfigFileError, suggest
from megaloop.config.tree import Config


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                validate: bool = True, world_size: int | None = None) -> Config:
    """Read a YAML config (or start from defaults when path is None), apply `section.key=value` overrides,
    and validate the whole tree (model, sizes, data directory) before anything is built."""
    raw: dict = {}
    if path is not None:
        raw = _read_config_file(Path(path))
        check_one_length(raw.get("train"), f"in {path}")
    given: dict = {}
    for item in overrides:
        _apply_override(given, item)
        _apply_override(raw, item)
    check_one_length(given.get("train"), "on the command line")
    if isinstance(raw.get("train"), dict) and isinstance(given.get("train"), dict):
        merge_lengths(raw["train"], set(given["train"]))
    cfg = from_dict(Config, raw, prefix="")
    resolve_steps(cfg)
    if validate:
        cfg.validate(world_size=world_size)
    return cfg


SECTIONS_HINT = "model, parallel, data, optim, train, checkpoint"


def shipped_configs() -> Path:
    """The checkout's configs/ folder, named so that a hint is right from any working directory (relative to it
    when it lies below, absolute otherwise)."""
    folder = Path(__file__).resolve().parents[2] / "configs"
    try:
        return folder.relative_to(Path.cwd())
    except ValueError:
        return folder


def _read_config_file(path: Path) -> dict:
    """The YAML mapping of a config file; every way it can be unusable is a ConfigFileError naming the file."""
    if path.is_dir():
        raise ConfigFileError(path, f"is a directory, not a config file; pass a YAML file such as "
                                    f"{shipped_configs() / 'parcae-tiny.yaml'}")
    if not path.is_file():
        raise FileNotFoundError(f"config file {path} does not exist (the shipped configs are "
                                f"{shipped_configs()}/*.yaml, e.g. {shipped_configs() / 'parcae-tiny.yaml'})")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigFileError(path, f"cannot be read as UTF-8 text ({err}); pass a readable YAML file") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigFileError(path, f"{_yaml_where(err)}malformed YAML ({_yaml_problem(err)}); fix the syntax "
                                    "there") from None
    if raw is None:
        raise ConfigFileError(path, f"holds no settings (empty or only comments); a config is a YAML mapping of "
                                    f"the sections {SECTIONS_HINT}, e.g. start from configs/parcae-tiny.yaml")
    if not isinstance(raw, dict):
        raise ConfigError("<root>", type(raw).__name__, f"{path} must hold a mapping of sections ({SECTIONS_HINT})")
    return raw


def _yaml_where(err) -> str:
    """'line L, column C: ' of a YAML error (1-based), or ''."""
    mark = getattr(err, "problem_mark", None) or getattr(err, "context_mark", None)
    return f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""


def _yaml_problem(err) -> str:
    """What PyYAML found, with where the construct it was parsing started when that is elsewhere."""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    context, start = getattr(err, "context", None), getattr(err, "context_mark", None)
    if not context:
        return problem
    if start is not None and start != getattr(err, "problem_mark", None):
        context += f" that starts at line {start.line + 1}, column {start.column + 1}"
    return f"{context}: {problem}"


def _apply_override(raw: dict, item: str) -> None:
    if "=" not in item:
        raise ConfigError("--set", item, "overrides look like section.key=value, e.g. train.steps=100")
    key, text = item.split("=", 1)
    parts = key.strip().split(".")
    node = raw
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(key, text, f"{part} is not a section")
    try:
        node[parts[-1]] = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError("--set", item, f"the value is not valid YAML ({_yaml_where(err)}{_yaml_problem(err)}); "
                                         "quote it or fix it, e.g. --set 'train.val_depths=[1, 4]'") from None


def from_dict(cls, data: dict, prefix: str):
    """Build dataclass `cls` from a mapping, rejecting unknown keys (with a suggestion) and wrong types."""
    if not isinstance(data, dict):
        raise ConfigError(prefix.rstrip(".") or "<root>", data, f"must be a mapping of {cls.__name__} fields")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            raise ConfigError(f"{prefix}{key}", value,
                              f"unknown key{suggest(key, names)}; valid keys: {', '.join(names)}")
        kwargs[key] = _coerce(hints[key], value, f"{prefix}{key}")
    return cls(**kwargs)


def _coerce(tp, value, name: str):
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value or {}, prefix=name + ".")
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for alternative in inner[:-1]:  # e.g. str | list[str]: the first type the value fits
            try:
                return _coerce(alternative, value, name)
            except ConfigError:
                pass
        return _coerce(inner[-1], value, name)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(name, value, f"must be a list, got {type(value).__name__}")
        elem = args[0] if args else typing.Any
        items = [_coerce(elem, v, f"{name}[{i}]") for i, v in enumerate(value)]
        if origin is tuple and len(args) > 1 and args[-1] is not Ellipsis and len(items) != len(args):
            raise ConfigError(name, value, f"must have {len(args)} entries")
        return tuple(items) if origin is tuple else items
    return _coerce_scalar(tp, value, name)


def _coerce_scalar(tp, value, name: str):
    if tp is typing.Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(name, value, f"must be true or false, got {type(value).__name__}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(name, value, f"must be an integer, got {type(value).__name__}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(name, value, f"must be a number, got {type(value).__name__}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(name, value, f"must be a string, got {type(value).__name__}")
    return value
