"""Step-indexed schedules: the trapezoid learning rate, Muon's momentum warm-up and Muon's weight-decay decay.

All three are pure functions of the training iteration (0-based: the first optimizer step is step 0), never of how
many steps were actually applied, so a skipped (non-finite) step does not shift the schedule. That matches the
reference, whose step counter advances whether or not the update was applied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .config import OptimConfig


def cooldown_steps(total_steps: int, cooldown_fraction: float) -> int:
    """Number of cool-down steps at the end of the run: floor(cooldown_fraction * total_steps), as the reference."""
    return int(math.floor(cooldown_fraction * total_steps + 1e-9))


def check_schedule(total_steps: int, warmup_steps: int, cooldown_fraction: float) -> None:
    """Raise ValueError when the run is too short for its warm-up and cool-down (they would overlap)."""
    if not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"total_steps = {total_steps!r} is invalid: it must be an integer >= 1")
    n_cool = cooldown_steps(total_steps, cooldown_fraction)
    if warmup_steps > total_steps - n_cool:
        raise ValueError(
            f"optim.warmup_steps = {warmup_steps} overlaps the cool-down: with total_steps = {total_steps} and "
            f"cooldown_fraction = {cooldown_fraction} the cool-down starts after step {total_steps - n_cool}; "
            f"set optim.warmup_steps <= {total_steps - n_cool}, or lower cooldown_fraction, or train longer"
        )


def lr_multiplier(
    step: int,
    total_steps: int,
    warmup_steps: int = 0,
    cooldown_fraction: float = 0.5,
    final_lr_fraction: float = 0.0,
) -> float:
    """The trapezoid schedule: the factor applied to every base learning rate at iteration ``step``.

    - warm-up (step < warmup_steps): (step + 1) / warmup_steps, so the first step is not wasted at lr 0;
    - constant 1 until step <= total_steps - n_cool, n_cool = floor(cooldown_fraction * total_steps);
    - cool-down: f + (1 - f) * (total_steps - step) / n_cool with f = final_lr_fraction, which reaches f at
      step == total_steps (one past the last executed step, as in the reference; the last executed step runs at
      f + (1 - f) / n_cool). Steps past the end stay at f.
    """
    if step < 0:
        raise ValueError(f"step = {step} is invalid: steps are counted from 0")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    n_cool = cooldown_steps(total_steps, cooldown_fraction)
    if step <= total_steps - n_cool:
        return 1.0
    if step >= total_steps:
        return final_lr_fraction
    return final_lr_fraction + (1.0 - final_lr_fraction) * (total_steps - step) / n_cool


def muon_momentum(step: int, start: float = 0.85, end: float = 0.95, warmup_steps: int = 300) -> float:
    """Muon's momentum at ``step``: linear from ``start`` (step 0) to ``end`` (step warmup_steps), then constant."""
    if warmup_steps <= 0:
        return end
    frac = min(step / warmup_steps, 1.0)
    return (1.0 - frac) * start + frac * end


def muon_weight_decay(step: int, total_steps: int, weight_decay: float) -> float:
    """Muon's weight decay at ``step``: weight_decay * (1 - step / total_steps), clamped at 0.

    This is the reference's rule (linear in the step, independent of the learning-rate schedule). The decay term
    is multiplied by the scheduled learning rate as well, so in the cool-down the effective decay lr_t * wd_t
    falls faster than either factor.
    """
    return weight_decay * max(0.0, 1.0 - step / total_steps)


@dataclass(frozen=True)
class ScheduledValues:
    """Every scheduled quantity at one iteration (what the optimizer uses and what the trainer logs)."""

    step: int
    lr_multiplier: float
    matrix_lr: float
    adam_lr: float
    muon_momentum: float
    muon_weight_decay: float


def scheduled_values(cfg: OptimConfig, step: int, total_steps: int) -> ScheduledValues:
    """Evaluate the learning-rate, momentum and weight-decay schedules of ``cfg`` at ``step``."""
    mult = lr_multiplier(step, total_steps, cfg.warmup_steps, cfg.cooldown_fraction, cfg.final_lr_fraction)
    start, end = cfg.muon_momentum
    return ScheduledValues(
        step=step,
        lr_multiplier=mult,
        matrix_lr=cfg.matrix_lr * mult,
        adam_lr=cfg.adam_lr * mult,
        muon_momentum=muon_momentum(step, start, end, cfg.muon_momentum_warmup_steps),
        muon_weight_decay=muon_weight_decay(step, total_steps, cfg.muon_weight_decay),
    )


def continued_values(cfg: OptimConfig, step: int, horizon: int) -> ScheduledValues:
    """The schedules of a run of ``horizon`` steps, continued past its end (train.extend=continue): from step
    ``horizon`` on, the learning rates and Muon's weight decay stay those of the run's last step (``horizon - 1``:
    the decayed rate it ended at, never the final_lr_fraction it would reach one step later, which is 0 by
    default); Muon's momentum follows its own warm-up, a function of the step alone. Before ``horizon`` this is
    :func:`scheduled_values`."""
    if step < horizon:
        return scheduled_values(cfg, step, horizon)
    start, end = cfg.muon_momentum
    last = scheduled_values(cfg, horizon - 1, horizon)
    return replace(last, step=step, muon_momentum=muon_momentum(step, start, end, cfg.muon_momentum_warmup_steps))
