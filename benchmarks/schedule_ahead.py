"""Host time per step that the ring schedule costs the training loop's thread: made in the step (before) against
made ahead in the data loader's prefetch thread (after, PipelineRuntime.plan_ahead).

    python benchmarks/schedule_ahead.py [--pp 8] [--micro-batches 32] [--mu-rec 8] [--steps 20] [--device-ms 200]

Each step has new micro-batch specs (laps uniform in [mu_rec / 2, 2 mu_rec], benchmarks/ring_schedule.py's
trainer_specs), so no schedule repeats. Before: the loop's thread generates each step's schedule when the step
starts (the device idles meanwhile). After: a thread standing in for the loader's prefetch thread (a queue of
`--prefetch` steps, as data.prefetch) generates step s+1.. while the loop's thread emulates the device's step
with a sleep of --device-ms (which releases the GIL, as waiting on a GPU does) and then looks its schedule up.
Printed: the median and largest time the loop's thread spends on the schedule per step, the step's wall time
(device + schedule before; device + any wait for the prefetch thread after: a prefetch thread slower than the device
shows here), and how many schedules the loop's thread still had to make itself. The runtime is PipelineRuntime
without its process groups (only its schedule cache is used).
"""
from __future__ import annotations

import argparse
import collections
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.ring_schedule import trainer_specs  # noqa: E402
from pipeline.pipeline_runtime import PipelineRuntime  # noqa: E402


def schedule_cache(pp: int) -> PipelineRuntime:
    """A PipelineRuntime holding only what its schedule cache needs (no layout: nothing here communicates)."""
    rt = object.__new__(PipelineRuntime)
    rt.pp, rt.stage, rt.in_flight = pp, 0, 3
    rt._schedules, rt._schedules_lock, rt.schedules_made_in_step = collections.OrderedDict(), threading.Lock(), 0
    return rt


def before(steps: list, pp: int, device_s: float) -> tuple[list[float], list[float], int]:
    rt, host, wall = schedule_cache(pp), [], []
    for specs in steps:
        t0 = time.perf_counter()
        rt._schedule(specs, ahead=False)
        host.append(time.perf_counter() - t0)
        time.sleep(device_s)
        wall.append(time.perf_counter() - t0)
    return host, wall, rt.schedules_made_in_step


def after(steps: list, pp: int, device_s: float, prefetch: int) -> tuple[list[float], list[float], int]:
    rt, host, wall, ready = schedule_cache(pp), [], [], queue.Queue(maxsize=prefetch)

    def produce():
        for specs in steps:
            rt._schedule(specs, ahead=True)
            ready.put(specs)

    worker = threading.Thread(target=produce, daemon=True)
    worker.start()
    for _ in steps:
        start = time.perf_counter()
        specs = ready.get()  # a step waits here when the prefetch thread falls behind: counted in the wall time
        t0 = time.perf_counter()
        rt._schedule(specs, ahead=False)
        host.append(time.perf_counter() - t0)
        time.sleep(device_s)
        wall.append(time.perf_counter() - start)
    worker.join()
    return host, wall, rt.schedules_made_in_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=8)
    ap.add_argument("--micro-batches", type=int, default=32)
    ap.add_argument("--mu-rec", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device-ms", type=float, default=200.0, help="the device's time per step (emulated)")
    ap.add_argument("--prefetch", type=int, default=4)
    a = ap.parse_args()
    steps = [trainer_specs(a.micro_batches, a.mu_rec, seed) for seed in range(a.steps)]
    print(f"pp {a.pp}, {a.micro_batches} micro-batches, mu_rec {a.mu_rec}, {a.steps} steps, device step "
          f"{a.device_ms:.0f} ms (emulated)")
    for name, (host, wall, made) in (("before (made in the step)", before(steps, a.pp, a.device_ms / 1e3)),
                               ("after (made in the prefetch thread)",
                                after(steps, a.pp, a.device_ms / 1e3, a.prefetch))):
        print(f"{name:>36}: schedule time in the loop's thread per step median {statistics.median(host) * 1e3:7.2f}"
              f" ms, max {max(host) * 1e3:7.2f} ms; step wall time median {statistics.median(wall[1:]) * 1e3:7.1f} "
              f"ms (after the first); schedules the loop's thread made: {made}/{len(steps)}")


if __name__ == "__main__":
    main()
