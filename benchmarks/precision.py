"""bf16 autocast vs fp32 on this machine: the same config, data and seed trained twice side by side in one process;
prints the tokens/s of each, their ratio, and the two loss curves.

    python benchmarks/precision.py --shards SHARD_DIR [--steps 60] [--set key=value ...]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def run(shards: str, steps: int, precision: str, overrides: list[str], out: Path):
    from megaloop.config import load_config
    from megaloop.train.loop import train

    sets = [f"data.shards={shards}", f"train.steps={steps}", f"train.precision={precision}",
            f"train.out_dir={out / precision}", "train.progress=false", f"train.val_every={steps}", *overrides]
    cfg = load_config(REPO / "configs" / "parcae-tiny.yaml", sets)
    summary = train(cfg)
    summary.mu_rec = cfg.model.mu_rec
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", required=True, help="a shard directory matching parcae-tiny (seq_len 128)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--every", type=int, default=10, help="print the loss curves every N steps")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fp32 = run(a.shards, a.steps, "fp32", a.overrides, Path(tmp))
        bf16 = run(a.shards, a.steps, "bf16", a.overrides, Path(tmp))
    print(f"tokens/s   fp32 {fp32.tokens_per_s:,.0f}   bf16 {bf16.tokens_per_s:,.0f}   "
          f"bf16/fp32 {bf16.tokens_per_s / fp32.tokens_per_s:.2f}x")
    print(f"{'step':>5} {'fp32 loss':>10} {'bf16 loss':>10} {'diff':>8}")
    for s in list(range(0, a.steps, a.every)) + [a.steps - 1]:
        print(f"{s:>5} {fp32.losses[s]:>10.4f} {bf16.losses[s]:>10.4f} {bf16.losses[s] - fp32.losses[s]:>+8.4f}")
    for t in sorted({1, fp32.mu_rec}):
        print(f"final val loss at T={t}: fp32 {fp32.val[t]['val_loss']:.4f}  bf16 {bf16.val[t]['val_loss']:.4f}")


if __name__ == "__main__":
    main()
