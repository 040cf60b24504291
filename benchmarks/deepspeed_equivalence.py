"""DeepSpeed as the data-parallel engine against the native one, every setting: megaloop's trainer on parcae-tiny at
dp=2 (gloo, fp32, AdamW, 6 steps, per-sequence depths, weight decay, clipping, the cool-down schedule) under ZeRO 1
and 2 against the native engine, ZeRO-3 with per-batch depths against the native engine on those depths, each at the
reference's AdamW eps 1e-10 (losses within 1e-5 relative) and, for ZeRO-2 with CPU offload and ZeRO-3, at eps 1e-6
(parameters too, within 1e-4); and a ZeRO-3 run with per-sequence depths, which must stop with the explanation.

    python benchmarks/deepspeed_equivalence.py [--corpus DIR]

Prints each run's losses and grad norms, its errors against its native reference, then one PASS/FAIL line per
setting. The settings and bounds are those of tests/pipeline/test_deepspeed.py, whose suite runs all but ZeRO-3 at
eps 1e-10. Exit status 1 when a setting fails. Needs DeepSpeed (scripts/setup.sh installs it). About a minute and a
half on 2 cores.
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

from benchmarks.pipeline_equivalence import build_shards, corpus_files  # noqa: E402
from tests.pipeline.test_deepspeed import SETTINGS, compare_settings, run_settings  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default=None, help="a folder of .txt files to build the shards from")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="deepspeed-equivalence-"))
    labels = list(SETTINGS)
    try:
        shards = build_shards(corpus_files(args.corpus), root)
        start = time.perf_counter()
        results = run_settings(shards, root / "runs", labels)
        print(f"{len(labels)} settings and the unequal ZeRO-3 run on 2 processes in {time.perf_counter() - start:.0f} s")
        failures = compare_settings(results, labels)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if "same number of loop steps" not in results["zero3_unequal"]:
        failures.append("zero3 per-sequence: did not stop with the explanation")
    failed = set()
    for label in labels + ["zero3 per-sequence"]:
        bad = [f for f in failures if f.startswith(f"{label}:")]
        failed.update([label] if bad else [])
        print(f"  {'FAIL' if bad else 'PASS'} {label}{': ' + '; '.join(bad) if bad else ''}")
    print("all settings PASS" if not failed else f"FAILED: {', '.join(sorted(failed))}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
