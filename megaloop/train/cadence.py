"""Time-based checkpoints (checkpoint.every_minutes): how much work a failure can cost, bounded by the clock rather
than by a step count that means minutes on one layout and hours on another.

Each rank keeps its own clock from the start of training (or its last save); when its interval has run out it puts
stopping.SAVE_DUE_CODE into the step's reduction, so every rank saves after the same step (agreed, one reduction the
step makes anyway). checkpoint.every (steps) and the final or stop save reset the clock as well.

every_minutes=auto picks the interval from the saves measured so far: the training stall of the slowest save
divided by AUTO_COST (so that saving costs about AUTO_COST of the time), at least the slowest background write (a
save never waits for the previous one) and at least AUTO_MIN_MINUTES (a tiny model's millisecond saves must not
write a checkpoint every few steps). Before the first save nothing is measured: the first interval is
AUTO_MIN_MINUTES. every_minutes=0 turns time-based saves off.
"""
from __future__ import annotations

import time

AUTO_COST = 0.02  # the share of training time saves may stall it under every_minutes=auto
AUTO_MIN_MINUTES = 10.0


def auto_interval_s(slowest_stall_s: float, slowest_write_s: float) -> float:
    """every_minutes=auto's interval in seconds, from the slowest save's training stall and background write."""
    return max(AUTO_MIN_MINUTES * 60.0, slowest_stall_s / AUTO_COST, slowest_write_s)


class Cadence:
    """One rank's clock for checkpoint.every_minutes (see the module docstring)."""

    def __init__(self, every_minutes: float | str, clock=time.monotonic):
        self.auto = every_minutes == "auto"
        self.fixed_s = None if self.auto else float(every_minutes) * 60.0
        self.clock = clock
        self.last = clock()

    def interval_s(self, slowest_stall_s: float = 0.0, slowest_write_s: float = 0.0) -> float | None:
        """The interval now (None: time-based saves are off)."""
        if self.auto:
            return auto_interval_s(slowest_stall_s, slowest_write_s)
        return self.fixed_s or None

    def due(self, slowest_stall_s: float = 0.0, slowest_write_s: float = 0.0) -> bool:
        """Whether this rank's interval has run out since the last save."""
        interval = self.interval_s(slowest_stall_s, slowest_write_s)
        return interval is not None and self.clock() - self.last >= interval

    def saved(self) -> None:
        """A checkpoint was saved (any kind): the interval starts again."""
        self.last = self.clock()

    def describe(self, slowest_stall_s: float = 0.0, slowest_write_s: float = 0.0) -> str:
        interval = self.interval_s(slowest_stall_s, slowest_write_s)
        if interval is None:
            return "off"
        return f"every {interval / 60:.3g} min" + (" (auto)" if self.auto else "")
