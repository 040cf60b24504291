"""The agreed stop on CPU (gloo), every layout: SIGTERM to the last rank of a dp2 job and of a tp2 x dp2 job
(`python -m megaloop train` processes started with a launcher's environment, parcae-tiny, fp32, 16 steps): every
rank must stop at one step with the stop code within 30 s, the checkpoint of that step committed, and re-running the
command must continue to the end with the uninterrupted run's per-step losses, bit for bit.

    python benchmarks/agreed_stop.py [--cases dp2,tp2xdp2] [--corpus DIR]

Prints each case's exit codes, stop step and whether the resumed losses are identical, then PASS/FAIL per case. The
cases and checks are those of tests/train/test_agreed_stop.py, whose suite runs tp2 x dp2 only. Exit
status 1 when a case fails. About a minute on 2 cores.
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
from tests.train.test_agreed_stop import CASES, test_sigterm_to_one_rank_stops_all_at_one_step  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    ap.add_argument("--corpus", default=None, help="a folder of .txt files to build the shards from")
    args = ap.parse_args()
    labels = [label.strip() for label in args.cases.split(",") if label.strip()]
    if not labels or set(labels) - set(CASES):
        ap.error(f"--cases {args.cases}: use a comma-separated subset of {','.join(CASES)}")
    root = Path(tempfile.mkdtemp(prefix="agreed-stop-"))
    failed = []
    try:
        shards = build_shards(corpus_files(args.corpus), root)
        for label in labels:
            world, tp = CASES[label]
            run_dir = root / label
            run_dir.mkdir()
            start = time.perf_counter()
            try:
                test_sigterm_to_one_rank_stops_all_at_one_step(world, tp, shards, run_dir)
                print(f"  PASS {label} ({time.perf_counter() - start:.0f} s)", flush=True)
            except AssertionError as err:
                failed.append(label)
                print(f"  FAIL {label}: {str(err)[-400:]}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("all cases PASS" if not failed else f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
