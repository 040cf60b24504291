"""The planner's data-parallel communication of parcae-1_3b on 16 x 8 H100 (tp 1, pp 1, dp 128), before and after
dp-scaled buckets and the overlapped parameter all-gather, at global batch 256 and 1024, fp32 and bf16 reduction.

  before  fixed 25 MiB buckets, the ZeRO-1 all-gather after the optimizer step (fully exposed)
  after   max(40M, 1M x dp) elements per bucket, the all-gather behind the next forward

    python benchmarks/plan_dp_exposure.py [--mfu 0.4] [--micro-batch 2]

Same as `python -m megaloop plan configs/parcae-1_3b.yaml --nodes 16 --gpus-per-node 8 --set
data.global_batch_size=G --set data.micro_batch_size=2 --set parallel.grad_reduce_dtype=W [--buckets fixed
--param-gather exposed] --json`, one model build for all eight.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mfu", type=float, default=0.4)
    ap.add_argument("--micro-batch", type=int, default=2)
    a = ap.parse_args()
    from megaloop.config import load_config
    from megaloop.plan.comm import AFTER, BEFORE, h100_cluster
    from megaloop.plan.gpus import GPUS
    from megaloop.plan.search import Planner
    from megaloop.plan.time_model import device_for

    world, ms = 128, 1e3
    device = device_for("h100", "bf16", a.mfu)
    print(f"parcae-1_3b, 16 x 8 H100, tp 1 pp 1 dp 128, micro-batch {a.micro_batch}, bf16 compute at "
          f"{a.mfu:g} of the dense peak; NVLink 450 GB/s 1 us, InfiniBand 50 GB/s per GPU 5 us")
    print(f"{'batch':>6} {'wire':>5} {'scheme':>7} {'calls':>6} {'reduce ms':>10} {'gather ms':>10} "
          f"{'exposed ms':>11} {'step ms':>8} {'exposed':>8}")
    for gb in (256, 1024):
        for wire in ("fp32", "bf16"):
            cfg = load_config(REPO / "configs/parcae-1_3b.yaml", [
                f"data.global_batch_size={gb}", f"data.micro_batch_size={a.micro_batch}",
                f"parallel.grad_reduce_dtype={wire}", "train.precision=bf16"], world_size=world)
            for name, comm in (("before", BEFORE), ("after", AFTER)):
                t = Planner(GPUS["h100"], world, device, h100_cluster(), comm, None).estimate(cfg).time
                print(f"{gb:>6} {wire:>5} {name:>7} {t.dp.calls:>6} {t.dp.reduce_s * ms:>10.1f} "
                      f"{t.dp.gather_s * ms:>10.1f} {t.dp_exposed_s * ms:>11.1f} {t.step_time_s * ms:>8.1f} "
                      f"{t.dp_exposed_s / t.step_time_s:>8.1%}", flush=True)


if __name__ == "__main__":
    main()
