"""Does a looped model learn, and does test-time depth help? Trains a config on a shard directory and compares its
validation loss at T = mu_rec with (a) the unigram cross-entropy of the validation split under the training split's
token frequencies, the best any context-free model can do (so the threshold is a property of the data, not a tuned
number), and (b) its own validation loss at T = 1.

    python benchmarks/convergence.py --shards SHARD_DIR [--config configs/parcae-tiny.yaml] [--set key=value ...]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    from megaloop.config import load_config
    from megaloop.eval.baselines import unigram_entropy
    from megaloop.train.loop import train

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", required=True)
    ap.add_argument("--config", default=str(REPO / "configs" / "parcae-tiny.yaml"))
    ap.add_argument("--out", default="runs/convergence")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    a = ap.parse_args()
    cfg = load_config(a.config, [f"data.shards={a.shards}", f"train.out_dir={a.out}", "train.progress=false",
                                 *a.overrides])
    summary = train(cfg)
    threshold = unigram_entropy(a.shards, "val", fit_split="train")
    mu = cfg.model.mu_rec
    val = {t: v["val_loss"] for t, v in summary.val.items()}
    print(f"{summary.steps_done} steps, {summary.tokens:,} tokens; train loss first 10 steps "
          f"{sum(summary.losses[:10]) / 10:.3f}, last 20 {sum(summary.losses[-20:]) / 20:.3f}")
    print("val loss by T: " + ", ".join(f"T={t}: {v:.4f}" for t, v in sorted(val.items())))
    print(f"threshold (unigram cross-entropy of val): {threshold:.4f}")
    below, deeper = val[mu] < threshold, val[mu] < val[1]
    print(f"T=mu_rec={mu}: {val[mu]:.4f} {'<' if below else '>='} threshold {threshold:.4f}: "
          f"{'PASS' if below else 'FAIL'}")
    print(f"T=mu_rec={mu}: {val[mu]:.4f} {'<' if deeper else '>='} T=1: {val[1]:.4f} "
          f"(by {val[1] - val[mu]:.4f}): {'PASS' if deeper else 'FAIL'}")
    return 0 if below and deeper else 1


if __name__ == "__main__":
    sys.exit(main())
