"""FP8 (train.fp8) under tp2, dp2, pp2 and tp2 x dp2 against FP8 in one process: parcae-tiny on 32-token shards,
10 steps, both recipes, fp32 and fp64. Prints per layout the worst per-step loss difference (relative) and how many
of the FP8 layers' scales (input, weight, output gradient) are bit-identical to the single process's: each layer's
first call, and every call of the run (compared as a sorted multiset per layer and role, since a pipeline schedule
runs the same calls in another order; row-wise weight scales of column-parallel layers are per-rank pieces and
appear among the first-call ones only, gathered).

    python benchmarks/fp8_layouts.py [--steps 10] [--recipes tensorwise rowwise] [--precisions fp32 fp64]

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

from benchmarks.pipeline_equivalence import build_shards, corpus_files  # noqa: E402
from tests.pipeline.spawn import spawn  # noqa: E402
from tests.pipeline.workers_fp8 import fp8_run, worker  # noqa: E402
from tests.pipeline.workers_train import ReferenceRuntime  # noqa: E402

TINY = ROOT / "configs" / "parcae-tiny.yaml"
LAYOUTS = {"tp2": (2, ["parallel.tp=2"]), "dp2": (2, []), "pp2": (2, ["parallel.pp=2"]),
           "tp2xdp2": (4, ["parallel.tp=2"])}


def overrides(shards, out_dir, recipe: str, precision: str, steps: int) -> list[str]:
    return [f"data.shards={shards}", f"train.out_dir={out_dir}", f"train.steps={steps}", "model.vocab_size=512",
            "model.seq_len=32", "data.micro_batch_size=2", "data.global_batch_size=16", "data.val_batches=0",
            "train.val_every=1000", "train.progress=false", f"train.precision={precision}",
            f"train.fp8={recipe}", "train.bucket_depths=false", "parallel.dp_balance=rows", "checkpoint.every=0"]


def compare(got: dict, ref: dict) -> dict:
    loss = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
    first = {k: v for k, v in ref["scales"].items() if not k.endswith(".calls")}
    same = [k for k, v in first.items() if k in got["scales"] and torch.equal(got["scales"][k], v)]
    weights = [k for k in first if k.endswith(".w")]
    calls = {k: v for k, v in ref["scales"].items() if k.endswith(".calls")}
    calls_same = [k for k, v in calls.items() if got["scales"].get(k) == v]
    return {"loss_rel": loss, "scales_equal": len(same), "scales": len(first),
            "calls_equal": sum(len(calls[k]) for k in calls_same), "calls": sum(len(v) for v in calls.values()),
            "weight_scales_equal": sum(k in same for k in weights), "weight_scales": len(weights),
            "missing": sorted(set(first) - set(got["scales"]))}


def layout_matrix(shards, root: Path, recipes, precisions, steps: int, layouts=LAYOUTS) -> dict:
    """{(layout, recipe, precision): comparison} against single-process runs made here."""
    results = {}
    for recipe in recipes:
        for precision in precisions:
            ref = fp8_run(str(TINY), overrides(shards, root / f"ref-{recipe}-{precision}", recipe, precision, steps),
                          lambda c, d: ReferenceRuntime(d))
            for world in sorted({w for w, _ in layouts.values()}):
                runs = {label: overrides(shards, root / f"{label}-{recipe}-{precision}", recipe, precision, steps)
                        + extra for label, (w, extra) in layouts.items() if w == world}
                out = root / f"runs-{world}-{recipe}-{precision}.pt"
                spawn(worker, world, str(TINY), runs, str(out))
                for label, got in torch.load(out).items():
                    results[label, recipe, precision] = compare(got, ref)
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--recipes", nargs="+", default=["tensorwise", "rowwise"])
    parser.add_argument("--precisions", nargs="+", default=["fp32", "fp64"])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        shards = build_shards(corpus_files(None), Path(tmp))
        results = layout_matrix(shards, Path(tmp), args.recipes, args.precisions, args.steps,
                                {k: LAYOUTS[k] for k in args.layouts})
    print(f"{'layout':8s} {'recipe':10s} {'prec':5s} {'loss rel err':>12s} {'first-call scales =':>20s} "
          f"{'weight scales =':>16s} {'every call, all steps =':>24s}")
    for (label, recipe, precision), r in results.items():
        print(f"{label:8s} {recipe:10s} {precision:5s} {r['loss_rel']:12.1e} {r['scales_equal']:>10d} / "
              f"{r['scales']:<7d} {r['weight_scales_equal']:>8d} / {r['weight_scales']:<5d} {r['calls_equal']:>12d} / "
              f"{r['calls']}"
              + (f"  missing {r['missing']}" if r["missing"] else ""))


if __name__ == "__main__":
    main()
