"""The markers a batch script reads in the run's out_dir: STOPPED (an agreed stop saved: requeue the job, unless it
says "requeue": false) and COMPLETED (the run is done). Written atomically by rank 0; JSON with the step and why."""
from __future__ import annotations

import json
from pathlib import Path

from megaloop.config import Config
from megaloop.train.checkpointing.common import checkpoint_root

MARKERS = ("STOPPED", "COMPLETED")


def write_marker(out_dir: str | Path, kind: str | None, **info) -> None:
    """Leave <out_dir>/<kind> with `info` and remove the other marker; kind None removes both (a job's start)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in MARKERS:
        if name != kind:
            (out / name).unlink(missing_ok=True)
    if kind is not None:
        tmp = out / f".{kind}.tmp"
        tmp.write_text(json.dumps(info) + "\n")
        tmp.replace(out / kind)


def mark_startup_stop(cfg: Config, signal_name: str) -> None:
    """<out_dir>/STOPPED for a stop signal during start-up (call on rank 0): nothing new was trained, so the step is
    the newest committed checkpoint's (0: none), and "during": "start-up" tells a batch script that this stop made no
    progress by design (slurm/body.py requeues it unless the previous job also stopped during start-up at that
    step: then start-up alone outlasts the allocation)."""
    from checkpoints.files import step_of
    from checkpoints.load import find_checkpoints

    steps = [step_of(p.name) for p in find_checkpoints(checkpoint_root(cfg))] if cfg.parallel.engine == "native" \
        else []
    write_marker(cfg.train.out_dir, "STOPPED", step=max([s for s in steps if s is not None], default=0),
                 reason=f"{signal_name} during start-up", during="start-up")
