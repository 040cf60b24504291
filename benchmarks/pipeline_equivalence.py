"""The ring pipeline's whole equivalence matrix on CPU (gloo): megaloop's trainer under pp2, pp4, pp2 x tp2,
pp2 x dp2 and pp2 x tp2 x dp2 (8 processes) for parcae-tiny with 4 core blocks, per-sequence depths (micro-batches
of different lap counts), Muon + AdamW, 8 steps, and GPT and RDM at pp2 and pp2 x dp2, each in fp64 and fp32 against the
single-process run of the same config. Point-to-point runs under NCCL's rendezvous semantics, emulated on gloo
(parallel.p2p_semantics=rendezvous: every send waits for its receive, one group's batches run in order).

    python benchmarks/pipeline_equivalence.py [--layouts pp2,pp2xtp2xdp2] [--corpus DIR]

For each layout and precision it prints the worst relative loss error over the steps, the worst parameter error (all
stages' parameters gathered), the worst validation error (at every depth 1 .. 2 mu_rec; under dp the validation set
is another one, so it is not compared) and how far the tied embedding's two copies (first and last stage) are apart;
then one PASS/FAIL line per layout: fp64 losses, parameters and validation within 1e-12, fp32 losses within 1e-3,
identical embedding copies. Exit status 1 when a layout fails.

The layouts, overrides, references and bounds are those of tests/pipeline/test_pipeline_trainer.py (which runs a
subset: pp2 in both precisions; GPT and RDM at pp2, pp2 x dp2, pp4 and pp2 x tp2 in fp64), from
tests/pipeline/pp_equivalence.py. The shards (vocab 512, 32-token rows) are built in a
temporary folder as the tests' tiny_shards fixture builds them: from the first 24 chapters of the shared corpus
beside the checkout (MEGALOOP_SHARED overrides where it is), else from the bundled data/sample_corpus, or from
--corpus. Each process runs one thread; 8 processes on a 2-core machine take several minutes.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from tests.pipeline.pp_equivalence import (FP32_LOSS_TOL, LAYOUTS, TINY, TOL, describe, failures,  # noqa: E402
                                           layout_runs, measure, references)
from benchmarks.corpus_shards import build_shards, corpus_files  # noqa: E402
from tests.pipeline.spawn import spawn  # noqa: E402
from tests.pipeline.workers_pp import worker  # noqa: E402

def parse_layouts(text: str) -> list[str]:
    labels = [label.strip() for label in text.split(",") if label.strip()]
    unknown = [label for label in labels if label not in LAYOUTS]
    if unknown or not labels:
        raise argparse.ArgumentTypeError(f"unknown layout(s) {unknown or text!r}: choose from {', '.join(LAYOUTS)}")
    return labels


def run_world(world: int, labels: list[str], shards: Path, root: Path) -> dict:
    """Every (label, precision) run of labels, one after another in one world of `world` processes."""
    runs = layout_runs(shards, root / f"world{world}", labels)
    out = root / f"world{world}.pt"
    spawn(worker, world, str(TINY), runs, str(out))
    return torch.load(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", type=parse_layouts, default=list(LAYOUTS),
                    help=f"comma-separated subset of {','.join(LAYOUTS)} (default: all)")
    ap.add_argument("--corpus", help="folder of .txt documents for the shards (default: see above)")
    a = ap.parse_args()
    verdicts = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        files = corpus_files(a.corpus)
        shards = build_shards(files, root / "data")
        print(f"shards from {len(files)} documents; {os.cpu_count()} CPU cores, one thread per process")
        start = time.perf_counter()
        refs = references(shards, root / "ref", sorted({LAYOUTS[label].arch for label in a.layouts}))
        print(f"single-process references (fp32, fp64): {time.perf_counter() - start:.0f} s")
        for world in sorted({LAYOUTS[label].world for label in a.layouts}):
            labels = [label for label in a.layouts if LAYOUTS[label].world == world]
            start = time.perf_counter()
            results = run_world(world, labels, shards, root)
            print(f"{world} processes: {', '.join(labels)} in {time.perf_counter() - start:.0f} s")
            for (label, precision), got in results.items():
                m = measure(got, refs[LAYOUTS[label].arch, precision])
                print("  " + describe(label, precision, m))
                verdicts.setdefault(label, []).extend(
                    f"{precision} {why}" for why in failures(LAYOUTS[label], precision, m))
    print(f"bounds: fp64 losses, parameters and validation within {TOL:.0e}; fp32 losses within {FP32_LOSS_TOL:.0e}; "
          "tied embedding copies identical")
    for label in a.layouts:
        bad = verdicts[label]
        print(f"{label:>12}: {'PASS' if not bad else 'FAIL (' + '; '.join(bad) + ')'}")
    if any(verdicts.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
