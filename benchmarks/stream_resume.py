"""Exact resume of a training streamed from S3 when the number of data-parallel ranks changes.

parcae-tiny on the chapters shards in moto's S3 (127.0.0.1), block order, gloo processes on the CPU:
1. fp32, dp 2: 40 straight steps; 20 steps stopped (train.stop_at_step) and re-run to 40 — losses bitwise equal.
2. fp64: 40 straight steps at dp 2; 20 steps at dp 2, resumed under dp 1 to 40 — the resumed losses against the
   straight ones (max relative difference; a different dp sums gradients in another order, so equality is to
   rounding, as for local shards: tests/pipeline/test_checkpoint_layouts.py), and the per-step tokens equal.
Rows per sample index under a dp change are checked bit for bit in the suite
(tests/data_prep/test_stream_sources.py::test_resume_at_step_20_under_another_dp_gives_the_same_rows_per_sample_index).

    python benchmarks/stream_resume.py [--steps 40] [--stop-at 20]
"""
from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from stream_common import REPO, build_shards

os.environ.setdefault("OMP_NUM_THREADS", "1")
TINY = REPO / "configs" / "parcae-tiny.yaml"


def overrides(url, endpoint, out_dir, steps: int, precision: str, *extra: str) -> list[str]:
    return [f"data.shards={url}", f"data.s3_endpoint={endpoint}", f"train.out_dir={out_dir}", f"train.steps={steps}",
            "model.vocab_size=512", "model.seq_len=32", "data.micro_batch_size=2", "data.global_batch_size=12",
            "data.val_batches=1", "train.val_every=1000", "train.progress=false", f"train.precision={precision}",
            "train.val_depths=[2]", "data.block_shards=4", "parallel.dp=null", *extra]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--stop-at", type=int, default=20)
    args = p.parse_args(argv)
    import torch

    from data_prep.local_servers import S3Server
    from tests.pipeline.spawn import spawn
    from tests.pipeline.workers_ckpt import worker

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shards = build_shards(tmp / "data")
        s3 = S3Server()
        url = s3.put_dir(shards, "corpus", "chapters")
        o = lambda out, precision, *extra: overrides(url, s3.endpoint, tmp / out, args.steps, precision,  # noqa: E731
                                                      f"data.cache_dir={tmp / ('cache-' + out)}", *extra)
        stop = f"train.stop_at_step={args.stop_at}"
        spawn(worker, 2, str(TINY), [("straight", o("a", "fp32")), ("first", o("b", "fp32", stop)),
                                     ("second", o("b", "fp32")), ("straight64", o("c", "fp64")),
                                     ("first64", o("d", "fp64", stop))], str(tmp / "dp2.pt"))
        spawn(worker, 1, str(TINY), [("resumed64", o("d", "fp64"))], str(tmp / "dp1.pt"))
        r = {**torch.load(tmp / "dp2.pt"), **torch.load(tmp / "dp1.pt")}
        s3.close()
    same = r["first"]["losses"] + r["second"]["losses"] == r["straight"]["losses"]
    print(f"1. fp32 dp 2: {args.steps} straight {r['straight']['losses'][0]:.6f} .. {r['straight']['losses'][-1]:.6f};"
          f" stopped at {args.stop_at} and resumed (start {r['second']['start']}): losses bitwise equal: {same}")
    straight, resumed = r["straight64"]["losses"][args.stop_at:], r["resumed64"]["losses"]
    rel = max(abs(a - b) / abs(a) for a, b in zip(straight, resumed))
    first_equal = r["first64"]["losses"] == r["straight64"]["losses"][:args.stop_at]
    print(f"2. fp64: dp 2 for {args.stop_at} steps (bitwise the straight run's: {first_equal}), resumed under dp 1 "
          f"(start {r['resumed64']['start']}): {len(resumed)} losses, max relative difference to the straight dp 2 "
          f"run {rel:.2e}")
    ok = same and first_equal and rel < 1e-12 and len(resumed) == args.steps - args.stop_at
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
