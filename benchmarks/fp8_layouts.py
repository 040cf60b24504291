"""FP8 (train.fp8) under tp2, dp2, pp2 and tp2 x dp2 against FP8 in one process: parcae-tiny on 32-token shards,
10 steps, both recipes, fp32 and fp64, each scale rounding asked for (train.fp8_scale_rounding; auto = the recipe's).
Prints per layout the worst per-step loss difference (relative) and how many of the FP8 layers' scales (input,
weight, output gradient) are bit-identical to the single process's: each layer's first call, and every call of the
run (each call's scale matched in the single process's calls of the same layer and role, as a multiset, since a
pipeline schedule runs the same calls in another order; row-wise weight scales of column-parallel layers, per-rank
pieces, are gathered whole first).

    python benchmarks/fp8_layouts.py [--steps 10] [--recipes tensorwise rowwise] [--precisions fp32 fp64]
                                     [--roundings auto pow2] [--layouts tp2 dp2 pp2 tp2xdp2]

Every layout sees the same micro-batches as the single process (train.bucket_depths=false, parallel.dp_balance=rows:
data-parallel rank r reads the r-th contiguous share), so each layer's first call has the same input; no validation
batches (their rows depend on dp by design: micro_batch_size x dp rows per batch), so every recorded call is a
training step's."""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from benchmarks.corpus_shards import build_shards, corpus_files  # noqa: E402
from tests.pipeline.spawn import spawn  # noqa: E402
from tests.pipeline.workers_fp8 import compare_runs, fp8_run, layout_overrides, worker  # noqa: E402
from tests.pipeline.workers_train import ReferenceRuntime  # noqa: E402

TINY = ROOT / "configs" / "parcae-tiny.yaml"
LAYOUTS = {"tp2": (2, ["parallel.tp=2"]), "dp2": (2, []), "pp2": (2, ["parallel.pp=2"]),
           "tp2xdp2": (4, ["parallel.tp=2"])}


def layout_matrix(shards, root: Path, recipes, precisions, steps: int, layouts=LAYOUTS,
                  roundings=("auto",)) -> dict:
    """{(layout, recipe, precision, rounding): comparison} against single-process runs made here."""
    results = {}
    cases = [(r, p, s) for r in recipes for p in precisions for s in roundings]
    for recipe, precision, rounding in tqdm(cases, desc="fp8 layouts", disable=len(cases) < 2):
        tag = f"{recipe}-{precision}-{rounding}"
        ref = fp8_run(str(TINY), layout_overrides(shards, root / f"ref-{tag}", recipe, precision, steps, rounding),
                      lambda c, d: ReferenceRuntime(d))
        for world in sorted({w for w, _ in layouts.values()}):
            runs = {label: layout_overrides(shards, root / f"{label}-{tag}", recipe, precision, steps, rounding) + extra
                    for label, (w, extra) in layouts.items() if w == world}
            out = root / f"runs-{world}-{tag}.pt"
            spawn(worker, world, str(TINY), runs, str(out))
            for label, got in torch.load(out).items():
                results[label, recipe, precision, rounding] = compare_runs(got, ref)
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--recipes", nargs="+", default=["tensorwise", "rowwise"])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "fp64"])
    parser.add_argument("--roundings", nargs="+", default=["auto"], choices=["auto", "pow2", "none"],
                        help="train.fp8_scale_rounding values to run (auto: the recipe's)")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        shards = build_shards(corpus_files(None), Path(tmp))
        results = layout_matrix(shards, Path(tmp), args.recipes, args.precisions, args.steps,
                                {k: LAYOUTS[k] for k in args.layouts}, args.roundings)
    print(f"{'layout':8s} {'recipe':10s} {'prec':5s} {'scales':6s} {'loss rel err':>12s} {'first-call scales =':>20s} "
          f"{'weight scales =':>16s} {'every call, all steps =':>24s}")
    for (label, recipe, precision, rounding), r in results.items():
        print(f"{label:8s} {recipe:10s} {precision:5s} {rounding:6s} {r['loss_rel']:12.1e} {r['scales_equal']:>10d} / "
              f"{r['scales']:<7d} {r['weight_scales_equal']:>8d} / {r['weight_scales']:<5d} {r['calls_equal']:>12d} / "
              f"{r['calls']}"
              + (f"  missing {r['missing']}" if r["missing"] else ""))


if __name__ == "__main__":
    main()
