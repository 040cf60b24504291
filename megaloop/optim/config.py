"""The optimizer's configuration: a plain dataclass with the reference's defaults.

The config tree (megaloop/config) imports :class:`OptimConfig` as its ``optim`` section, so this file depends on
nothing but the standard library and stays a plain dataclass with defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

OPTIMIZER_NAMES = ("muon", "adamw")
MAX_NS_STEPS = 5  # the reference gives exactly five Polar Express coefficient triples


@dataclass
class OptimConfig:
    """Hyperparameters of Muon + AdamW and of the trapezoid learning-rate schedule.

    Defaults are the Parcae reference's (PARCAE_REFERENCE.md section 7) for the 140M/370M models.

    name: "muon" (2-D weights on Muon, the rest on AdamW) or "adamw" (every parameter on AdamW).
    matrix_lr: Muon's base learning rate (before the shape factor sqrt(max(1, rows/cols))).
    adam_lr, betas, eps, adam_weight_decay: the AdamW groups.
    muon_momentum: (start, end) of Muon's momentum, linear over muon_momentum_warmup_steps, then constant.
    nesterov: Nesterov momentum for Muon.
    muon_weight_decay: cautious decoupled weight decay at step 0, decaying linearly to 0 at the last step.
    normuon_beta2: decay of NorMuon's factored second moment.
    ns_steps: number of Polar Express iterations (1..5).
    grad_clip: global gradient-norm clip (0 disables clipping; the norm is still measured).
    warmup_steps: linear learning-rate warm-up steps (0: none).
    cooldown_fraction: fraction of the run over which the learning rate falls linearly at the end.
    final_lr_fraction: learning-rate multiplier reached at the end of the cool-down.
    """

    name: str = "muon"
    matrix_lr: float = 8e-3
    adam_lr: float = 8e-3
    betas: tuple[float, float] = (0.8, 0.95)
    eps: float = 1e-10
    adam_weight_decay: float = 0.0
    muon_momentum: tuple[float, float] = (0.85, 0.95)
    muon_momentum_warmup_steps: int = 300
    nesterov: bool = True
    muon_weight_decay: float = 0.2
    normuon_beta2: float = 0.95
    ns_steps: int = 5
    grad_clip: float = 1.0
    warmup_steps: int = 0
    cooldown_fraction: float = 0.5
    final_lr_fraction: float = 0.0

    def validate(self) -> "OptimConfig":
        """Check every field; raise ValueError naming the first bad field and its allowed values. Returns self."""
        if self.name not in OPTIMIZER_NAMES:
            _fail("name", self.name, f"one of {OPTIMIZER_NAMES}")
        for field in ("matrix_lr", "adam_lr", "eps"):
            _check_real(self, field, lambda v: v > 0, "a finite number > 0")
        for field in ("adam_weight_decay", "muon_weight_decay", "grad_clip"):
            _check_real(self, field, lambda v: v >= 0, "a finite number >= 0")
        _check_real(self, "normuon_beta2", lambda v: 0 <= v < 1, "a number in [0, 1)")
        _check_real(self, "cooldown_fraction", lambda v: 0 <= v <= 1, "a number in [0, 1]")
        _check_real(self, "final_lr_fraction", lambda v: 0 <= v <= 1, "a number in [0, 1]")
        _check_pair(self, "betas", "two numbers in [0, 1), e.g. (0.8, 0.95)")
        _check_pair(self, "muon_momentum", "two numbers (start, end) in [0, 1), e.g. (0.85, 0.95)")
        _check_int(self, "muon_momentum_warmup_steps", 0, None, "an integer >= 0")
        _check_int(self, "warmup_steps", 0, None, "an integer >= 0")
        _check_int(self, "ns_steps", 1, MAX_NS_STEPS, f"an integer in 1..{MAX_NS_STEPS}")
        if not isinstance(self.nesterov, bool):
            _fail("nesterov", self.nesterov, "True or False")
        return self


class OptimConfigError(ValueError):
    """An invalid optimizer setting: `field` (e.g. "optim.matrix_lr"), the bad `value`, what is `allowed`.

    A ValueError, so library callers catch it as before; the config tree reports it as a config error."""

    def __init__(self, field: str, value: object, allowed: str):
        self.field, self.value, self.allowed = field, value, allowed
        super().__init__(f"{field} = {value!r} is invalid: allowed values are {allowed}")


def _fail(field: str, value: object, allowed: str) -> None:
    default = OptimConfig.__dataclass_fields__[field].default
    hint = f" (the default is {list(default) if isinstance(default, tuple) else default})"
    raise OptimConfigError(f"optim.{field}", value, allowed + hint)


def _is_real(value: object) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(float(value))


def _check_real(cfg: OptimConfig, field: str, ok, allowed: str) -> None:
    value = getattr(cfg, field)
    if not _is_real(value) or not ok(float(value)):
        _fail(field, value, allowed)


def _check_int(cfg: OptimConfig, field: str, low: int, high: int | None, allowed: str) -> None:
    value = getattr(cfg, field)
    if not isinstance(value, int) or isinstance(value, bool) or value < low or (high is not None and value > high):
        _fail(field, value, allowed)


def _check_pair(cfg: OptimConfig, field: str, allowed: str) -> None:
    value = getattr(cfg, field)
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        _fail(field, value, allowed)
    if not all(_is_real(v) and 0 <= float(v) < 1 for v in value):
        _fail(field, value, allowed)
