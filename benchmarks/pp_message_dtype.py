"""bf16 against fp32 messages between ring-pipeline stages: the same pp2 training run (parcae-tiny, bf16 autocast,
same shards, config and seed) twice, with parallel.pp_message_dtype=fp32 and =bf16, and the two loss curves
compared step by step.

    python benchmarks/pp_message_dtype.py [--shards SHARD_DIR] [--steps 200] [--set key=value ...]

Prints the max and mean absolute loss difference over all steps and over the last tenth, the final losses (mean of
the last ten steps) of both runs and their step times. Without --shards, seq_len-128 shards of the bundled sample
corpus are built in a temporary folder (benchmarks/parallel_layouts.py).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.parallel_layouts import build_shards, micro_batch_size, run_layout  # noqa: E402


def curve(shards: Path, steps: int, out: Path, overrides: list[str], dtype: str) -> list[dict]:
    sets = overrides + ["train.precision=bf16", "train.log_every=1", f"parallel.pp_message_dtype={dtype}"]
    return run_layout("pp2", shards, steps, out, sets, micro_batch_size("pp2", sets))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", help="a shard directory matching parcae-tiny (seq_len 128); default: built")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="extra config override")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        shards = Path(a.shards) if a.shards else build_shards(Path(tmp))
        runs = {dtype: curve(shards, a.steps, Path(tmp) / dtype, a.overrides, dtype) for dtype in ("fp32", "bf16")}
    fp32, bf16 = ([r["loss"] for r in runs[d]] for d in ("fp32", "bf16"))
    diff = [abs(x - y) for x, y in zip(fp32, bf16)]
    tail = max(len(diff) // 10, 1)
    print(f"parcae-tiny pp2, bf16 autocast, {len(diff)} steps, messages fp32 vs bf16")
    print(f"|loss difference|: max {max(diff):.4f}, mean {statistics.mean(diff):.4f}; last {tail} steps: max "
          f"{max(diff[-tail:]):.4f}, mean {statistics.mean(diff[-tail:]):.4f}")
    for dtype, losses in (("fp32", fp32), ("bf16", bf16)):
        times = [r["time_step"] for r in runs[dtype][3:]]
        print(f"{dtype} messages: first loss {losses[0]:.4f}, final loss (mean of last 10) "
              f"{statistics.mean(losses[-10:]):.4f}, median step {statistics.median(times) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
