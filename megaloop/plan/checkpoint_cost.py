"""What checkpoints cost a planned job and what a failure costs it, from the config's checkpoint cadence.

A save (checkpoints/save.py) writes every global array once: the parameters (pb bytes each) and the optimizer state
(Muon's momentum and its per-row or per-column vector, AdamW's two moments; static.py's element counts), spread
over the ranks. A rank's training stall is the copy of its share to host memory (D2H_GBPS) plus the agreement of
the save plan (AGREE_S); the background write of the whole checkpoint runs at the storage's aggregate bandwidth.
checkpoint.every_minutes (auto: megaloop.train.cadence) and checkpoint.every (steps, at the planned step time) set
the interval; the shorter one counts. A failure at a random time loses half an interval of training on average and
a whole one at most, before the restart's own start-up and resume.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from megaloop.plan.static import _muon_state
from megaloop.train.cadence import AUTO_COST, Cadence

D2H_GBPS = 20.0  # device-to-host copy into pinned buffers, per GPU (PCIe Gen5 x16 runs at ~25-50 GB/s)
AGREE_S = 0.5  # the save plan's gather and scatter over the job


@dataclass(frozen=True)
class CheckpointCost:
    total_bytes: int  # one checkpoint
    rank_bytes: int  # the share one rank copies and writes
    stall_s: float  # training time one save takes from each rank
    write_s: float  # the background write of the whole checkpoint
    interval_s: float | None  # between saves (None: only at the end and at stops)
    overhead: float  # stall / interval: the share of training time saves cost
    mean_loss_s: float | None  # training lost by a failure at a random time, on average (None: all of it)

    def as_dict(self) -> dict:
        return asdict(self)


def checkpoint_bytes(params, precision: str) -> int:
    """The bytes of one checkpoint of the model whose parameters (planner LocalParams, full shapes) are `params`."""
    pb = 8 if precision == "fp64" else 4
    n = sum(p.full_numel for p in params)
    muon = sum(_muon_state(p.full_shape) for p in params if p.optimizer == "muon")
    adamw = 2 * sum(p.full_numel for p in params if p.optimizer == "adamw")
    return pb * (n + muon + adamw)


def checkpoint_cost(plan, step_time_s: float, storage_gbps: float) -> CheckpointCost:
    """The cost of the config's cadence for the planned job (see the module docstring)."""
    cfg, world = plan.cfg, plan.layout.world
    full = [p for p in plan.params]
    total = checkpoint_bytes(full, cfg.train.precision)
    rank = -(-total // world)
    stall = rank / (D2H_GBPS * 1e9) + AGREE_S
    write = total / (storage_gbps * 1e9)
    intervals = [Cadence(cfg.checkpoint.every_minutes).interval_s(stall, write)]
    if cfg.checkpoint.every:
        intervals.append(cfg.checkpoint.every * step_time_s)
    interval = min((i for i in intervals if i), default=None)
    return CheckpointCost(total, rank, stall, write, interval, stall / interval if interval else 0.0,
                          interval / 2 if interval else None)


def checkpoint_lines(cost: CheckpointCost, cfg, storage_gbps: float) -> list[str]:
    every = cfg.checkpoint.every_minutes
    cadence = (f"checkpoint.every_minutes=auto (stall / {AUTO_COST:.0%}, at least the write and 10 min)"
               if every == "auto" else f"checkpoint.every_minutes={every:g}")
    if cfg.checkpoint.every:
        cadence += f", checkpoint.every={cfg.checkpoint.every} steps"
    lines = ["", f"checkpoints: {cost.total_bytes / 1e9:.2f} GB each, {cost.rank_bytes / 1e6:.0f} MB per rank; "
             f"stall {cost.stall_s:.2f} s per save (device-to-host at {D2H_GBPS:g} GB/s + {AGREE_S:g} s to agree), "
             f"write {cost.write_s:.1f} s in the background at {storage_gbps:g} GB/s (--storage-gbps)"]
    if cost.interval_s is None:
        lines.append(f"  {cadence}: saves only at the end and at stops; a failure loses everything since the job "
                     "started")
        return lines
    lines.append(f"  {cadence}: every {cost.interval_s / 60:.1f} min, {cost.overhead:.2%} of the training time; a "
                 f"failure loses {cost.mean_loss_s / 60:.1f} min of training on average (at most "
                 f"{cost.interval_s / 60:.1f}), plus the restart")
    return lines
