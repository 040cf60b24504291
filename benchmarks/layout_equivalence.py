"""The tensor/data-parallel equivalence matrix on CPU (gloo): megaloop's trainer on parcae-tiny (20 steps,
per-sequence depths, gradient accumulation, Muon + AdamW) under tp2, dp2, and GPT and RDM at tp2 (2 processes), and
tp2 x dp2, tp4, dp4, GPT and RDM at tp2 x dp2 (4 processes), each in fp64 and fp32, against the single-process run of
the same config.

    python benchmarks/layout_equivalence.py [--worlds 2,4] [--layouts "tp2xdp2,gpt tp2xdp2"] [--corpus DIR]

Per layout and precision it prints the worst relative loss error over the 20 steps and the worst parameter error,
then PASS or FAIL against the bounds of tests/pipeline/test_layout_equivalence.py (fp64: losses and parameters
within 1e-12; fp32 sanity bounds: losses 1e-5, parameters 5e-3 or twice the single process's 1-vs-2-thread noise),
whose suite runs a representative subset of this matrix. Exit status 1 when a layout fails. The shards are built as
benchmarks/pipeline_equivalence.py builds them. About 10 minutes on 2 cores.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.corpus_shards import build_shards, corpus_files  # noqa: E402
from tests.pipeline.spawn import spawn  # noqa: E402
import tests.pipeline.test_layout_equivalence as suite  # noqa: E402
from tests.pipeline.test_layout_equivalence import MATRIX, TINY, compare, layout_runs, reference_run  # noqa: E402
from tests.pipeline.workers_train import worker  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", default="2,4", help="comma-separated process counts of MATRIX to run (2, 4)")
    ap.add_argument("--layouts", default=None,
                    help="comma-separated labels of MATRIX to run (default: every layout of --worlds)")
    ap.add_argument("--corpus", default=None, help="a folder of .txt files to build the shards from")
    args = ap.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    suite.STEPS = 20  # the suite runs fewer
    if not set(worlds) <= set(MATRIX):
        ap.error(f"--worlds {args.worlds}: use a comma-separated subset of {sorted(MATRIX)}")
    known = [label for world in worlds for label in MATRIX[world]]
    labels = known if args.layouts is None else [label.strip() for label in args.layouts.split(",")]
    if not labels or set(labels) - set(known):
        ap.error(f"--layouts {args.layouts}: use a comma-separated subset of {', '.join(known)}")
    root = Path(tempfile.mkdtemp(prefix="layout-equivalence-"))
    failed = []
    try:
        shards = build_shards(corpus_files(args.corpus), root)
        refs = {}
        for world in worlds:
            t0 = time.perf_counter()
            layouts = {label: layout for label, layout in MATRIX[world].items() if label in labels}
            if not layouts:
                continue
            runs = layout_runs(shards, root / f"world{world}", layouts)
            spawn(worker, world, str(TINY), runs, str(root / f"runs{world}.pt"))
            results = torch.load(root / f"runs{world}.pt")
            print(f"{world} processes: {len(runs)} runs in {time.perf_counter() - t0:.0f} s", flush=True)
            for label, precision in runs:
                arch = MATRIX[world][label][0]
                if (arch, precision) not in refs:
                    refs[arch, precision] = reference_run(shards, root / "ref", arch, precision)
                try:
                    compare(label, precision, results[label, precision], refs[arch, precision])
                    print(f"  PASS {label} {precision}", flush=True)
                except AssertionError as err:
                    failed.append(f"{label} {precision}")
                    print(f"  FAIL {label} {precision}: {err}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("all layouts PASS" if not failed else f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
