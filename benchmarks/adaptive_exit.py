"""Adaptive depth per token against fixed depths at equal compute, on a trained checkpoint.

    python benchmarks/adaptive_exit.py RUN_DIR [--shards DIR] [--rows 16] [--depth 8] [--eps 0.3,0.1,0.03,0.01]

Feeds the first ROWS validation rows one position at a time through the KV cache per lap (megaloop.eval.kv_cache):
fixed T = 1..DEPTH, then adaptive depth with each threshold eps (a token stops looping once
||h_t - h_{t-1}|| / ||h_t|| < eps, at most DEPTH laps). Prints the fixed-T losses and, per eps, the mean laps per
token, the loss, and the fixed-T loss at the same mean laps (linear between the neighbouring integer T).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaloop.eval.checkpoint import load_model  # noqa: E402
from megaloop.eval.depth_eval import validation_rows  # noqa: E402
from megaloop.eval.generate import adaptive_table  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--shards", default=None, help="default: the run's data.shards")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--depth", type=int, default=None, help="most laps (default 2 mu_rec)")
    ap.add_argument("--eps", default="0.3,0.1,0.03,0.01")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    loaded = load_model(args.checkpoint)
    depth = args.depth or 2 * loaded.model_config.mu_rec
    rows, _ = validation_rows(args.shards or loaded.config["data"]["shards"], args.rows)
    table = adaptive_table(loaded.model, rows.tokens, depth, args.seed, [float(e) for e in args.eps.split(",")])
    print(f"{loaded.path} (step {loaded.step}, mu_rec {loaded.model_config.mu_rec}), {args.rows} validation rows "
          f"x {rows.tokens.shape[1] - 1} tokens, h_0 seed {args.seed}")
    print("fixed T: " + ", ".join(f"T={t} {loss:.4f}" for t, loss in table["fixed"].items()))
    print(f"{'eps':>8}  {'mean laps':>9}  {'loss':>7}  {'fixed T, same laps':>18}  {'delta':>8}")
    for r in table["adaptive"]:
        print(f"{r['eps']:>8g}  {r['mean_laps']:>9.3f}  {r['loss']:>7.4f}  {r['fixed_loss_at_equal_compute']:>18.4f}"
              f"  {r['delta']:>+8.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
