"""A parcae-tiny run with a loss spike at step N, and what train.on_spike does with it. --cause lr: the update of
step N-1 runs at --factor x the learning rate (the damage is in the state; it comes back after every rollback, since
the schedule is a function of the step); --cause batch: the batch of step N is corrupted (every token the last id,
MEGALOOP_FAULTS=spike:step=N). Prints the "spike" and "rollback" records, how the run ended (stop: exit 75, no
checkpoint of step N or later; rollback: the checkpoint restored, the batches skipped, and for --cause lr the bound
train.max_rollbacks stopping the run), its last training losses and the checkpoints left.

Usage (from the repository root, shards as scripts/quickstart.sh makes them):
    python benchmarks/spike_stop.py --shards runs/quickstart/shards [--step 40] [--factor 300] [--out DIR]
    python benchmarks/spike_stop.py --shards runs/quickstart/shards --action rollback --cause batch
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaloop.config import load_config  # noqa: E402
from megaloop.optim.combined import CombinedOptimizer  # noqa: E402
from megaloop.train.cli import run_training  # noqa: E402
from megaloop.train.metrics import read_metrics  # noqa: E402

TINY = Path(__file__).resolve().parents[1] / "configs" / "parcae-tiny.yaml"


def force_lr_spike(step: int, factor: float) -> None:
    original = CombinedOptimizer.schedule_at

    def schedule_at(self, s):
        values = original(self, s)
        if s != step - 1:
            return values
        return dataclasses.replace(values, matrix_lr=values.matrix_lr * factor, adam_lr=values.adam_lr * factor)

    CombinedOptimizer.schedule_at = schedule_at


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", type=Path, required=True)
    ap.add_argument("--step", type=int, default=40, help="the step whose loss jumps (N)")
    ap.add_argument("--factor", type=float, default=300.0)
    ap.add_argument("--action", default="stop", choices=("log", "skip", "rollback", "stop"))
    ap.add_argument("--cause", default="lr", choices=("lr", "batch"))
    ap.add_argument("--every", type=int, default=10, help="checkpoint.every (steps; default 10)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="spike_"))
    if args.cause == "lr":
        force_lr_spike(args.step, args.factor)
    else:
        os.environ["MEGALOOP_FAULTS"] = f"spike:step={args.step}"
    cfg = load_config(TINY, [f"data.shards={args.shards}", f"train.out_dir={out}", f"train.steps={args.step + 20}",
                             f"train.on_spike={args.action}", "train.val_every=1000", "train.progress=false",
                             f"checkpoint.every={args.every}"])
    code = run_training(cfg)
    records = read_metrics(out / "metrics.jsonl")
    cause = (f"lr x{args.factor:g} in the update of step {args.step - 1}" if args.cause == "lr" else
             f"the batch of step {args.step} corrupted")
    print(f"exit status {code}; {cause}")
    for r in records:
        if r["kind"] in ("spike", "rollback"):
            print(f"{r['kind']} record:", json.dumps(r))
    losses = [(r["step"], round(r["loss"], 4)) for r in records if r["kind"] == "train"]
    print("last training losses (step, loss):", losses[-5:])
    ckpt = out / "checkpoints"
    print("checkpoints:", sorted(p.name for p in ckpt.iterdir()) if ckpt.is_dir() else "none")
    summary = json.loads((out / "summary.json").read_text())
    print(f"summary: steps_done {summary['steps_done']}, interrupted {summary['interrupted']}, "
          f"stop_reason {summary['stop_reason']!r}")
    stopped = out / "STOPPED"
    print("STOPPED:", stopped.read_text().strip() if stopped.exists() else "none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
