"""The memory planner's predicted peak against the measured peak of real CPU training steps.

Each configuration runs in fresh processes (one per rank): the runtime, model and optimizer are built and two
training steps run (the optimizer state exists from the first). Two measurements, each in its own processes:

  allocator  inside `megaloop.plan.measure.live_tensor_peak`, the running sum of the CPU allocator's own records:
             the peak of bytes held by live tensors, the quantity torch.cuda.max_memory_allocated reports on a GPU
             and the one the planner predicts. Frees made on threads the profiler does not follow (gloo's) are
             missed, so under several processes this figure drifts upwards from step to step.
  rss        after a first build and step (the libraries' one-time memory), the peak resident set during a
             second build + two steps (VmHWM, reset first) minus the resident set before, with
             every block above 64 KiB mmapped (MALLOC_MMAP_THRESHOLD_, as benchmarks/loop_memory.py) so that a
             freed tensor leaves the resident set at once; it also counts the process's non-tensor memory.

The allocator's fragmentation and the CUDA context are what the planner's GPU headroom covers. Depths are fixed at mu_rec (model.depth_sampler=
fixed) so that every micro-batch keeps mu_bwd laps, the case the planner sizes for. Multi-process layouts report
the most loaded rank on both sides.

    python benchmarks/plan_accuracy.py [--only NAME ...] [--checkpointing none block lap]

Then the plan of parcae-1_3b at seq 2048 on 8 x H100 80GB: the largest micro-batch under each checkpointing
setting, with the breakdown.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import socket
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# name -> (config, world size, overrides)
CASES = {
    "parcae-tiny": ("configs/parcae-tiny.yaml", 1, []),
    "parcae-tiny dp2": ("configs/parcae-tiny.yaml", 2, ["parallel.dp=2"]),
    "parcae-tiny tp2": ("configs/parcae-tiny.yaml", 2, ["parallel.tp=2"]),
    "parcae-tiny dp4": ("configs/parcae-tiny.yaml", 4, ["parallel.dp=4", "data.micro_batch_size=4",
                                                       "train.precision=fp32"]),
    # several buckets per chunk: the reducer's and the overlapped all-gather's copies in flight are planned
    "parcae-tiny dp4 buckets": ("configs/parcae-tiny.yaml", 4, ["parallel.dp=4", "data.micro_batch_size=4",
                                                               "train.precision=fp32",
                                                               "parallel.grad_bucket_elements=262144"]),
    "parcae-140m seq128": ("configs/parcae-140m.yaml", 1, ["model.seq_len=128", "data.micro_batch_size=2",
                                                           "data.global_batch_size=4"]),
}
COMMON = ["model.depth_sampler=fixed", "train.progress=false"]


def _config(path: str, overrides: list[str], checkpointing: str):
    from megaloop.config import load_config

    return load_config(REPO / path, [*COMMON, *overrides, f"train.activation_checkpointing={checkpointing}"])


def _rss_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


@contextlib.contextmanager
def _rss_peak():
    """result["peak"]: bytes of resident-set growth at its highest inside the block."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM
    before, result = _rss_kib("VmRSS"), {}
    yield result
    result["peak"] = (_rss_kib("VmHWM") - before) * 1024


def _measure_rank(rank: int, world: int, port: int, path: str, overrides: list[str], checkpointing: str,
                  out_dir: str, how: str) -> None:
    """One rank: build and run two training steps inside the measurement; write the peak to out_dir."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch

    from megaloop.depth import make_sampler
    from megaloop.plan.measure import live_tensor_peak
    from megaloop.train.flops import FlopModel
    from megaloop.train.loop import build_model_and_optimizer
    from megaloop.train.runtime import make_runtime
    from megaloop.train.step import train_step

    torch.set_num_threads(1)
    cfg = _config(path, overrides, checkpointing)
    m, device = cfg.model, torch.device("cpu")
    rows = cfg.data.global_batch_size // (world // cfg.parallel.tp)
    sampler = make_sampler("fixed", m.mu_rec, m.backprop_depth, seed=0)
    runtime = make_runtime(cfg, device)

    def run(steps: int) -> None:
        model, optimizer = build_model_and_optimizer(cfg, runtime, device)
        gen = torch.Generator().manual_seed(runtime.dp_rank)
        for step in range(steps):
            index = torch.arange(rows) + runtime.dp_rank * rows + step * cfg.data.global_batch_size
            batch = {"tokens": torch.randint(0, m.vocab_size, (rows, m.seq_len + 1), generator=gen),
                     "sample_index": index}
            train_step(model, optimizer, batch, sampler.sample(step, index), step, 0, cfg, runtime,
                       FlopModel.of(m))

    if how == "rss":
        run(1)  # libraries' one-time memory (kernels, thread pools, gloo buffers) before the baseline
        runtime.finish_param_gather()
        for name in ("model", "_buffer", "_reducer", "_parts"):  # the runtime's hold on the warm-up's model
            if hasattr(runtime, name):
                setattr(runtime, name, None)
        gc.collect()
    with (live_tensor_peak() if how == "allocator" else _rss_peak()) as live:
        run(2)
    runtime.close()
    peak = live.peak if how == "allocator" else live["peak"]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"peak": peak}))


def measure(path: str, world: int, overrides: list[str], checkpointing: str, how: str) -> int:
    """The largest per-rank measured peak (bytes) over `world` fresh processes; how: allocator | rss."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_measure_rank, args=(world, port, path, overrides, checkpointing, out_dir, how), nprocs=world,
                 join=True)
        return max(json.loads(p.read_text())["peak"] for p in Path(out_dir).glob("rank*.json"))


def predict(path: str, world: int, overrides: list[str], checkpointing: str) -> int:
    from megaloop.plan.gpus import GPUS
    from megaloop.plan.planner import make_plan

    cfg = _config(path, overrides, checkpointing)
    return make_plan(cfg, GPUS["h100"], world).at(cfg.data.micro_batch_size).peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=sorted(CASES), default=sorted(CASES))
    ap.add_argument("--checkpointing", nargs="+", choices=("none", "block", "lap"), default=["none", "block", "lap"])
    ap.add_argument("--skip-1_3b", action="store_true", help="do not print the parcae-1_3b plan")
    a = ap.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the measuring processes
    print(f"{'configuration':<20}{'ckpt':<6}{'predicted MiB':>14}{'allocator MiB':>14}{'error':>8}"
          f"{'rss MiB':>10}{'error':>8}")
    for name in a.only:
        path, world, overrides = CASES[name]
        for ck in a.checkpointing:
            pred = predict(path, world, overrides, ck)
            alloc, rss = (measure(path, world, overrides, ck, how) for how in ("allocator", "rss"))
            print(f"{name:<20}{ck:<6}{pred / 2**20:>14.1f}{alloc / 2**20:>14.1f}{pred / alloc - 1:>+8.1%}"
                  f"{rss / 2**20:>10.1f}{pred / rss - 1:>+8.1%}", flush=True)
    if not a.skip_1_3b:
        from megaloop.__main__ import main as megaloop_main

        print()
        megaloop_main(["plan", str(REPO / "configs/parcae-1_3b.yaml"), "--gpu", "h100", "--nodes", "1",
                       "--gpus-per-node", "8"])


if __name__ == "__main__":
    main()
