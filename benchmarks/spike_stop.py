"""A parcae-tiny run forced to diverge: the update of step N-1 runs at --factor x the learning rate, so the loss of
step N jumps. Prints the "spike" records the run logged, how it ended (train.on_spike=stop: exit 75, a checkpoint
at step N+1 and a message naming the step) and its last training losses.

Usage (from the repository root, shards as scripts/quickstart.sh makes them):
    python benchmarks/spike_stop.py --shards runs/quickstart/shards [--step 40] [--factor 300] [--out DIR]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
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
    ap.add_argument("--action", default="stop", choices=("log", "skip", "stop"))
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="spike_"))
    force_lr_spike(args.step, args.factor)
    cfg = load_config(TINY, [f"data.shards={args.shards}", f"train.out_dir={out}", f"train.steps={args.step + 20}",
                             f"train.on_spike={args.action}", "train.val_every=1000", "train.progress=false"])
    code = run_training(cfg)
    records = read_metrics(out / "metrics.jsonl")
    print(f"exit status {code}; lr x{args.factor:g} in the update of step {args.step - 1}")
    for r in records:
        if r["kind"] == "spike":
            print("spike record:", json.dumps(r))
    losses = [(r["step"], round(r["loss"], 4)) for r in records if r["kind"] == "train"]
    print("last training losses (step, loss):", losses[-5:])
    ckpt = out / "checkpoints"
    print("checkpoints:", sorted(p.name for p in ckpt.iterdir()) if ckpt.is_dir() else "none")
    summary = json.loads((out / "summary.json").read_text())
    print(f"summary: steps_done {summary['steps_done']}, interrupted {summary['interrupted']}, "
          f"stop_reason {summary['stop_reason']!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
