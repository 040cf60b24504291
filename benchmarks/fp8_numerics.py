"""FP8 numerics on parcae-140m: the real looped forward and backward (truncated backprop, k = min(T, mu_bwd)) at
T = 1, 4, 8 with each recipe, against the same model in fp32: SQNR of the logits and of the worst weight gradient
(torchao's thresholds: 18 dB and 17 dB), with the core in FP8 (the trainer's default) and with prelude and coda too.
Then the T-lap FP8 core's gradients against an unrolled copy of it (separate copies of the core per lap).

    python benchmarks/fp8_numerics.py [--config configs/parcae-140m.yaml] [--seq 256] [--rows 2]

The reference init zeroes the blocks' output projections (the blocks would add nothing and FP8 would change
nothing): they get N(0, 0.02) values first, as after some training. The sequence is cut to --seq positions so that
it runs on a CPU in minutes."""
from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LOGIT_SQNR, GRAD_SQNR, UNROLLED_TOL = 18.0, 17.0, 1e-6


def main(argv=None) -> int:
    from tqdm import tqdm

    from megaloop.config import load_config
    from megaloop.model import build_model
    from megaloop.train.fp8 import CORE
    from pipeline.fp8 import convert_to_float8
    from tests.pipeline.fp8_numerics import batch, fp8_vs_fp32, looped_vs_unrolled, nonzero_projections_

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "configs" / "parcae-140m.yaml"))
    ap.add_argument("--seq", type=int, default=256, help="positions per sequence")
    ap.add_argument("--rows", type=int, default=2, help="sequences in the batch")
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 4, 8])
    a = ap.parse_args(argv)
    cfg = load_config(a.config, [f"model.seq_len={a.seq}"]).model
    model = build_model(cfg, device="cpu", seed=0)
    nonzero_projections_(model)
    ids, labels, h0 = batch(cfg, a.rows, cfg.seq_len)
    ok = True
    cases = [(r, t, outer) for outer in (False, True) for r in ("tensorwise", "rowwise") for t in a.depths]
    lines = []
    for recipe, depth, outer in tqdm(cases, desc="fp8 vs fp32"):
        k = min(depth, cfg.backprop_depth)
        got = fp8_vs_fp32(model, recipe, ids, labels, h0, depth, k, outer=outer)
        passed = got["logits"] >= LOGIT_SQNR and got["grad"] >= GRAD_SQNR
        ok &= passed or outer  # the thresholds apply to the trainer's default (the core)
        lines.append(f"{'core+prelude+coda' if outer else 'core':17s} {recipe:10s} T={depth} k={k}: logits "
                     f"{got['logits']:5.1f} dB, worst weight grad {got['grad']:5.1f} dB ({got['worst']}), "
                     f"{got['converted']} FP8 layers{'' if passed else '  BELOW'}")
    print("\n".join(lines))
    core = copy.deepcopy(model)
    convert_to_float8(core, "tensorwise", CORE)
    errors = looped_vs_unrolled(core, ids, labels, h0, 8, cfg.backprop_depth)
    worst = max(errors, key=errors.get)
    print(f"T=8 k={cfg.backprop_depth} FP8 core vs unrolled copies: worst gradient rel err {errors[worst]:.1e} "
          f"({worst}; bound {UNROLLED_TOL:g})")
    ok &= errors[worst] <= UNROLLED_TOL
    print(f"all within bounds: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
