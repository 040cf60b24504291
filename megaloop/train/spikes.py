"""Loss-spike detection during training (train.on_spike).

A step's loss (the job-wide token mean) is a spike when it exceeds the rolling median of the last
train.spike_window non-spike losses by more than train.spike_k x their MAD (median absolute deviation; floored at
MAD_FLOOR x the median so a flat stretch does not flag rounding noise), or when it is not finite. Nothing is judged
before SPIKE_MIN_HISTORY losses are known. Spike losses never enter the window, so a divergence keeps being flagged.

Each spike is logged as a "spike" metrics record with the loop's health at that step: rho(A) (the injection's
spectral radius) and ||h_T|| (state_norm). Then train.on_spike acts:
  log   nothing more;
  skip  the step's update is not applied (its gradients are dropped and the step counts as skipped): the loss is
        judged from the step's packed statistics before the optimizer runs, which costs one host read of them
        before the update (a device sync on a GPU, where the clip decision syncs anyway);
  rollback  the run restores its newest checkpoint from before the spike's step, skips a window of
        train.rollback_skip global batches ending at the spike's (none before the checkpoint's position; recorded
        in a "rollback" metrics record with their sample indices) and trains on from the checkpoint's step. At most
        train.max_rollbacks per run; past that, or with no checkpoint to go back to, it stops as under `stop`.
  stop  the run stops after the step WITHOUT saving: the state the spike's step left (its update, computed from the
        spiking batch) is never the newest checkpoint, and any checkpoint of the spike's step or later is set aside
        (<name>.after-spike). The STOPPED marker says requeue: false, so a batch script does not start the run again
        on its own: it needs a person (a lower learning rate, other data, train.on_spike=rollback).
Every rank judges the same job-wide loss, so every rank takes the same decision.

The skipped windows (SkipWindows) are checkpointed with the trainer's state: step k reads global batch k + offset,
where offset counts the batches skipped before it, so a run resumed after a rollback reads what the rolled-back run
would have read.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

SPIKE_MIN_HISTORY = 20
MAD_FLOOR = 1e-3
ACTIONS = ("log", "skip", "rollback", "stop")


@dataclass
class Spike:
    step: int
    loss: float
    median: float
    mad: float
    threshold: float

    def record(self, telemetry: dict, action: str) -> dict:
        """The "spike" metrics record (megaloop.train.metrics.SPIKE_FIELDS)."""
        return {"kind": "spike", "step": self.step, "loss": self.loss, "median": self.median, "mad": self.mad,
                "threshold": self.threshold, "rho_A": float(telemetry.get("rho_A", float("nan"))),
                "state_norm": float(telemetry.get("state_norm", float("nan"))), "action": action}


class SpikeDetector:
    """loss > rolling median + k x MAD over the last `window` non-spike losses."""

    def __init__(self, k: float, window: int, min_history: int = SPIKE_MIN_HISTORY):
        self.k, self.min_history = k, min(min_history, window)
        self.history: deque = deque(maxlen=window)

    def check(self, step: int, loss: float) -> Spike | None:
        if len(self.history) < self.min_history:
            if math.isfinite(loss):
                self.history.append(loss)
            return None
        h = np.fromiter(self.history, dtype=float)
        median = float(np.median(h))
        mad = max(float(np.median(np.abs(h - median))), MAD_FLOOR * abs(median))
        threshold = median + self.k * mad
        if math.isfinite(loss) and loss <= threshold:
            self.history.append(loss)
            return None
        return Spike(step, loss, median, mad, threshold)

    def state_dict(self) -> dict:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict) -> None:
        self.history.clear()
        self.history.extend(float(x) for x in state["history"])  # the newest `window` if the window shrank


class SpikeMonitor:
    """train.on_spike for the training loop: `veto` (skip only) judges a step before its update; `after_step` gives
    the step's spike (judged now, or by the veto), if any."""

    def __init__(self, train_cfg, runtime):
        self.action = train_cfg.on_spike
        self.detector = SpikeDetector(train_cfg.spike_k, train_cfg.spike_window)
        self.runtime = runtime
        self._vetoed: Spike | None = None
        self.veto = self._veto if self.action == "skip" else None

    def state_dict(self) -> dict:
        """The detector's window: checkpointed, so that a resumed run judges its first steps as the straight run."""
        return self.detector.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.detector.load_state_dict(state)

    @property
    def stops(self) -> bool:
        return self.action == "stop"

    def _veto(self, stats, step: int) -> bool:
        from megaloop.train.step import reduce_step

        self._vetoed = self.detector.check(step, reduce_step(stats, self.runtime).loss)
        return self._vetoed is not None

    def after_step(self, step: int, loss: float) -> Spike | None:
        if self.veto is not None:
            spike, self._vetoed = self._vetoed, None
            return spike if spike is not None and spike.step == step else None
        return self.detector.check(step, loss)


def stop_message(spike: Spike, out_dir: str, why: str | None = None) -> str:
    """The line a spike stop prints; why: the reason a rollback could not be made instead."""
    instead = f" ({why}: stopping instead of rolling back)" if why else ""
    return (f"megaloop: loss spike at step {spike.step}: loss {spike.loss:.4g} > median {spike.median:.4g} + "
            f"k x MAD {spike.mad:.3g} (threshold {spike.threshold:.4g}){instead}; stopped without saving the state "
            f"after it: the newest checkpoint in {out_dir} is from before the spike, and the run is not requeued. "
            "Re-run the command to continue from that checkpoint, e.g. with a lower learning rate or "
            "train.on_spike=rollback")


class SkipWindows:
    """The global batches that rollbacks skip, and the loader's offset from the step: step k reads global batch
    k + offset, jumping over the windows (each [first, last], inclusive) it reaches. Saved with every checkpoint."""

    def __init__(self):
        self.offset = 0
        self.rollbacks = 0
        self.windows: list[list[int]] = []

    def batch_of(self, step: int) -> int:
        """The global batch `step` reads, as far as the windows are known (advance() jumps over them)."""
        return step + self.offset

    def advance(self, step: int) -> int:
        """The global batch `step` reads: step + offset, past every window that holds it (the offset grows)."""
        batch = self.batch_of(step)
        moved = True
        while moved:
            moved = False
            for first, last in self.windows:
                if first <= batch <= last:
                    self.offset += last + 1 - batch
                    batch, moved = last + 1, True
        return batch

    def rolled_back(self, offset: int, first: int, last: int) -> None:
        """A rollback restored a checkpoint whose step reads batch step + `offset`, and skips batches first..last."""
        self.offset = offset
        self.rollbacks += 1
        self.windows.append([first, last])

    def state_dict(self) -> dict:
        return {"offset": self.offset, "rollbacks": self.rollbacks, "windows": [list(w) for w in self.windows]}

    def load_state_dict(self, state: dict) -> None:
        self.offset, self.rollbacks = int(state["offset"]), int(state["rollbacks"])
        self.windows = [[int(a), int(b)] for a, b in state["windows"]]
