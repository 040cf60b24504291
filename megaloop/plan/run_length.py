"""The run a plan prices: how many optimizer steps, from where, and what they cost in days and GPU-hours.

The trainer runs whole steps of global_batch_size x seq_len tokens, so a budget in tokens is priced as the steps the
trainer would run for it (megaloop/config/budget.py): ceil(tokens / tokens per step) steps of the planned step time.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from megaloop.config.budget import human_tokens, tokens_per_step

SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True)
class RunLength:
    steps: int
    tokens_per_step: int
    source: str  # where the length comes from: "train.tokens=104B", "train.steps", "--tokens 1e+09"

    @property
    def tokens(self) -> int:
        return self.steps * self.tokens_per_step

    def days(self, step_time_s: float) -> float:
        return self.steps * step_time_s / (24 * SECONDS_PER_HOUR)

    def gpu_hours(self, step_time_s: float, gpus: int) -> float:
        return self.steps * step_time_s * gpus / SECONDS_PER_HOUR

    def line(self, step_time_s: float, gpus: int, gpu_name: str) -> str:
        return (f"  the run: {human_tokens(self.tokens)} tokens = {self.steps:,} steps ({self.source}): "
                f"{self.days(step_time_s):.2f} days on {gpus} x {gpu_name} = "
                f"{self.gpu_hours(step_time_s, gpus):,.0f} GPU-hours")

    def as_dict(self, step_time_s: float, gpus: int) -> dict:
        return {"tokens": self.tokens, "steps": self.steps, "source": self.source, "days": self.days(step_time_s),
                "gpu_hours": self.gpu_hours(step_time_s, gpus)}


def run_length(cfg, tokens: float | None = None) -> RunLength:
    """The config's run (train.tokens or train.steps), or `tokens` (plan --tokens) when given."""
    per_step = tokens_per_step(cfg)
    if tokens:
        return RunLength(math.ceil(tokens / per_step), per_step, f"--tokens {tokens:.3g}")
    if cfg.train.tokens is not None:
        return RunLength(cfg.train.steps, per_step, f"train.tokens={human_tokens(cfg.train.tokens)}")
    return RunLength(cfg.train.steps, per_step, "train.steps")
