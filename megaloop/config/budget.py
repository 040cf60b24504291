"""A run's length as a token budget (train.tokens) or as optimizer steps (train.steps): exactly one is given.

The published runs are specified in tokens (80 per nominal parameter), and a step is one global batch of
global_batch_size x seq_len tokens, so steps = ceil(tokens / (global_batch_size x seq_len)): the run trains at least
the budget, at most one batch more. The rule "exactly one" applies per source: a config file that sets both is an
error, and so is a command line that overrides both; an override of one replaces the other from the file, so that
`--set train.steps=100` still shortens a file that carries the published budget in tokens.
"""
from __future__ import annotations

import math
import re

from megaloop.config.errors import ConfigError

_SUFFIX = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_TOKENS = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*$")
LENGTH_KEYS = ("steps", "tokens")


def parse_tokens(value) -> int:
    """A token count from a number or a string such as 104e9, 104B, 11.2B, 500M (k/M/B(G)/T: 1e3/1e6/1e9/1e12).
    YAML reads 104e9 (no decimal point) as a string, so strings are the common case, not an exotic one."""
    if isinstance(value, bool):
        raise ConfigError("train.tokens", value, "must be a token count such as 104e9 or 104B")
    if isinstance(value, (int, float)):
        number = float(value)
    else:
        match = _TOKENS.match(str(value))
        if match is None:
            raise ConfigError("train.tokens", value, "must be a token count such as 104e9, 1.04e11 or 104B "
                              "(suffixes k, M, B, T)")
        number = float(match.group(1)) * _SUFFIX[match.group(2).lower()]
    if not math.isfinite(number) or number <= 0:
        raise ConfigError("train.tokens", value, "must be a positive token count such as 104e9 or 104B")
    return int(round(number))


def check_one_length(section: dict | None, source: str) -> None:
    """Refuse a source (the config file, or the command line's overrides) that gives both train.steps and
    train.tokens: which one was meant cannot be told."""
    given = [k for k in LENGTH_KEYS if isinstance(section, dict) and section.get(k) is not None]
    if len(given) == 2:
        raise ConfigError("train.tokens", section["tokens"], f"is given together with train.steps="
                          f"{section['steps']} {source}; give exactly one (steps = ceil(tokens / (global batch x "
                          "seq_len)))")


def merge_lengths(file_train: dict, override_keys: set[str]) -> None:
    """An override of train.steps or train.tokens replaces the file's other one (in place)."""
    for key, other in (("steps", "tokens"), ("tokens", "steps")):
        if key in override_keys and other not in override_keys:
            file_train.pop(other, None)


def resolve_steps(cfg) -> None:
    """Set cfg.train.steps from cfg.train.tokens (when given), with cfg.train.tokens as an integer count.
    A budget smaller than one step is refused: it would train a whole step of tokens it did not ask for."""
    t = cfg.train
    if t.tokens is None:
        return
    t.tokens = parse_tokens(t.tokens)
    per_step = tokens_per_step(cfg)
    if t.tokens < per_step:
        raise ConfigError("train.tokens", t.tokens, f"is smaller than one step (data.global_batch_size x "
                          f"model.seq_len = {cfg.data.global_batch_size} x {cfg.model.seq_len} = {per_step:,} "
                          f"tokens); give at least {per_step:,} tokens, or train.steps")
    t.steps = math.ceil(t.tokens / per_step)


def tokens_per_step(cfg) -> int:
    return cfg.data.global_batch_size * cfg.model.seq_len


def human_tokens(n: float) -> str:
    """104000000000 -> '104B', 11200000000 -> '11.2B', 524288 -> '524.3k' (three significant figures at most)."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.4g}{suffix}" if n / div < 1000 else f"{n / div:,.0f}{suffix}"
    return f"{n:g}"


def budget_line(cfg) -> str:
    """The run's length both ways, e.g. '104B tokens (train.tokens) = 198,365 steps x 256 x 2048 tokens
    (104,000,389,120 tokens trained)' or '300 steps (train.steps) x 16 x 128 tokens = 614.4k tokens'."""
    t, per_step = cfg.train, tokens_per_step(cfg)
    shape = f"{cfg.data.global_batch_size} x {cfg.model.seq_len} tokens"
    if t.tokens is None:
        return f"{t.steps:,} steps (train.steps) x {shape} = {human_tokens(t.steps * per_step)} tokens"
    return (f"{human_tokens(t.tokens)} tokens (train.tokens) = {t.steps:,} steps x {shape} "
            f"({t.steps * per_step:,} tokens trained)")


def run_record(cfg) -> dict:
    """The run's length for summary.json: steps, tokens per step, the tokens they train, train.tokens as given."""
    per_step = tokens_per_step(cfg)
    return {"steps": cfg.train.steps, "tokens_per_step": per_step, "tokens": cfg.train.steps * per_step,
            "tokens_given": cfg.train.tokens}
