"""`megaloop eval` against the trainer's own validation on the same rows of a trained checkpoint.

    python benchmarks/eval_vs_trainer.py RUN_DIR [--shards DIR] [--rows 128] [--depths 1,4,8]

Runs megaloop.train.evaluate.validation_losses (single-process runtime, fp32) on the first ROWS validation rows in
batches of 16 and `python -m megaloop eval RUN_DIR --val-rows ROWS --json` as a separate process, and prints both
losses per T with their difference (the acceptance bound is 1e-6).
"""
from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data_prep.loader import validation_batches  # noqa: E402
from megaloop.eval.checkpoint import load_model  # noqa: E402
from megaloop.train.evaluate import validation_losses  # noqa: E402
from megaloop.train.runtime import SingleProcessRuntime  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--shards", default=None, help="default: the run's data.shards")
    ap.add_argument("--rows", type=int, default=128, help="a multiple of 16 (default 128)")
    ap.add_argument("--depths", default="1,4,8")
    args = ap.parse_args()
    loaded = load_model(args.run_dir)
    shards = args.shards or loaded.config["data"]["shards"]
    seed = int(loaded.config.get("train", {}).get("seed", 0))
    depths = [int(t) for t in args.depths.split(",")]
    batches = list(itertools.islice(validation_batches(shards, 16, 0, 1, verify="none"), args.rows // 16))
    cpu = torch.device("cpu")
    trainer = validation_losses(loaded.model, batches, depths, seed=seed, precision="fp32", device=cpu,
                                runtime=SingleProcessRuntime(cpu))
    done = subprocess.run([sys.executable, "-m", "megaloop", "eval", args.run_dir, "--shards", shards, "--depths",
                           args.depths, "--val-rows", str(len(batches) * 16), "--json"], capture_output=True,
                          text=True, cwd=REPO, check=True)
    ours = json.loads(done.stdout)["depths"]
    worst = 0.0
    for t in depths:
        a, b = trainer[t]["val_loss"], ours[str(t)]["loss"]
        worst = max(worst, abs(a - b))
        print(f"T={t}: trainer validation_losses {a:.9f}  megaloop eval {b:.9f}  |diff| {abs(a - b):.2e}")
    print(f"largest difference {worst:.2e} ({'within' if worst < 1e-6 else 'OUTSIDE'} 1e-6)")
    return 0 if worst < 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
