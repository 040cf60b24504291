"""The time planner's predicted step time against measured CPU training steps (gloo on localhost).

The planner's "cpu" device: the peak is this machine's cached fp32 matmul rate on one thread (`python -m megaloop
peak`, measured now when missing) at the efficiency given by --mfu, and the link is gloo on localhost as measured
here first by a probe of two processes: each collective kind (all-reduce, all-gather, reduce-scatter, and the
all-to-all of the bf16 gradient reduction) timed at 64 KiB, 1 MiB and 16 MiB and fitted on its own to latency +
bytes / bandwidth per ring step. gloo's collectives are not all
bandwidth-optimal rings (its reduce-scatter costs about an all-reduce), and on a CPU they share the cores with the
compute, so the probe calls them as a step does: between a few milliseconds of matmul, without a barrier, and keeps
the mean (about twice the cost of back-to-back calls after a barrier). A tp layout makes hundreds of ~1 MiB calls a
step. Each layout then runs in fresh processes, one thread each: the
runtime, model and optimizer are built, --warmup steps run, then --steps timed steps (a barrier before each, the
slowest rank's time kept); the median is the measured step time. Depths are fixed at mu_rec
(model.depth_sampler=fixed), as the planner's rank-0 micro-batches then stand for every rank.

With layout 1 measured, a second table: the efficiency that makes layout 1's prediction equal its CPU time, and
every layout predicted at that efficiency (the planner's efficiency is a stated input; this states it from one run
and predicts the parallel layouts).

    python benchmarks/plan_time_accuracy.py [--only 1 dp2 tp2 pp2] [--steps 3] [--mfu 1.0]

The machine should be idle: a shared CPU makes the measured times long and noisy (the ratio is what matters).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CONFIG = "configs/parcae-tiny.yaml"
# a CPU-sized model whose matmuls dominate the step: d 512, 8 heads, 1/2/1 layers, seq 256
MODEL = ["model.d_model=512", "model.n_heads=8", "model.seq_len=256", "model.vocab_size=4096",
         "model.depth_sampler=fixed", "data.global_batch_size=8", "data.micro_batch_size=2",
         "train.precision=fp32", "train.progress=false"]
PEAK_BUDGET_S = 0.5
LAYOUTS = {"1": (1, []), "dp2": (2, ["parallel.dp=2"]), "tp2": (2, ["parallel.tp=2"]),
           "pp2": (2, ["parallel.pp=2"])}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")


PROBE_KIB = (64, 1024, 16384)  # whole-tensor sizes of the probe's calls: tp activations ~1 MiB, dp buckets more


def _probe_rank(rank: int, port: int, out_dir: str) -> None:
    _env(rank, 2, port)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    calls = {"all_reduce": lambda full, half: dist.all_reduce(full),
             "all_gather": lambda full, half: dist.all_gather_single(full, half),
             "reduce_scatter": lambda full, half: dist.reduce_scatter_single(half, full),
             "all_to_all": lambda full, half: dist.all_to_all_single(torch.empty_like(full), full)}
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    result = {}
    for kind, call in calls.items():
        for kib in PROBE_KIB:
            full = torch.ones(kib * 256)
            half = torch.ones(kib * 128)
            for _ in range(3):
                call(full, half)
            dist.barrier()
            times = []
            for _ in range(max(8, 64 * 1024 // kib)):
                for _ in range(4):  # a few ms of matmul between calls, as in a step
                    a @ b
                t0 = time.perf_counter()
                call(full, half)
                times.append(time.perf_counter() - t0)
            result[f"{kind} {kib}"] = statistics.mean(times)
    dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def _fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(bandwidth, latency) of t = latency + x / bandwidth over (x bytes per step, t s per step), least squares on
    relative error (small and large calls weigh alike); latency >= 0."""
    import numpy as np

    x, t = np.array(points).T
    a = np.stack([np.ones_like(x), x], axis=1) / t[:, None]
    (latency, per_byte), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    if latency < 0:
        latency, per_byte = 0.0, float(np.sum(x / t) / np.sum((x / t) ** 2))
    return 1.0 / per_byte, float(latency)


def probe_gloo():
    """gloo on localhost as a planner link, each collective kind fitted on its own (see the module docstring)."""
    import torch.multiprocessing as mp

    from megaloop.plan.comm import KINDS, Link, ring_steps

    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_probe_rank, args=(_free_port(), out_dir), nprocs=2, join=True)
        r = json.loads(Path(out_dir, "rank0.json").read_text())
    fits = {}
    for kind in KINDS:  # 2 ranks: each step moves half the whole tensor
        steps = ring_steps(kind, 2)
        fits[kind] = _fit([(kib * 1024 / 2, r[f"{kind} {kib}"] / steps) for kib in PROBE_KIB])
    bandwidth, latency = fits["all_reduce"]
    return Link(bandwidth, latency, tuple((k, *fits[k]) for k in KINDS))


def _train_rank(rank: int, world: int, port: int, overrides: list[str], warmup: int, steps: int,
                out_dir: str) -> None:
    _env(rank, world, port)
    import torch
    import torch.distributed as dist

    from megaloop.config import load_config
    from megaloop.depth import make_sampler
    from megaloop.train.flops import FlopModel
    from megaloop.train.loop import build_model_and_optimizer
    from megaloop.train.peak import measure_cpu_peak
    from megaloop.train.runtime import make_runtime
    from megaloop.train.step import train_step

    torch.set_num_threads(1)
    cfg = load_config(REPO / CONFIG, MODEL + overrides, world_size=world)
    m, device = cfg.model, torch.device("cpu")
    runtime = make_runtime(cfg, device)
    dp = cfg.parallel.dp or world // (cfg.parallel.tp * cfg.parallel.pp)
    rows = cfg.data.global_batch_size // dp
    sampler = make_sampler("fixed", m.mu_rec, m.backprop_depth, seed=0)
    model, optimizer = build_model_and_optimizer(cfg, runtime, device)
    gen = torch.Generator().manual_seed(runtime.dp_rank)
    times, cpu_times, peaks = [], [], [measure_cpu_peak(torch.float32, PEAK_BUDGET_S).tflops]
    for step in range(warmup + steps):
        index = torch.arange(rows) + runtime.dp_rank * rows + step * cfg.data.global_batch_size
        batch = {"tokens": torch.randint(0, m.vocab_size, (rows, m.seq_len + 1), generator=gen),
                 "sample_index": index}
        if world > 1:
            dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        train_step(model, optimizer, batch, sampler.sample(step, index), step, 0, cfg, runtime, FlopModel.of(m))
        if step >= warmup:
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
    peaks.append(measure_cpu_peak(torch.float32, PEAK_BUDGET_S).tflops)
    runtime.close()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"wall": times, "cpu": cpu_times, "peak": peaks}))


def measure(world: int, overrides: list[str], warmup: int, steps: int) -> tuple[float, float, float]:
    """Medians over steps of the slowest rank's wall and CPU step time (s), and the lowest matmul peak (TFLOP/s)
    the ranks measured just before and after their steps."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_train_rank, args=(world, _free_port(), overrides, warmup, steps, out_dir), nprocs=world, join=True)
        ranks = [json.loads(p.read_text()) for p in Path(out_dir).glob("rank*.json")]
    wall = statistics.median(max(ts) for ts in zip(*(r["wall"] for r in ranks)))
    cpu = statistics.median(max(ts) for ts in zip(*(r["cpu"] for r in ranks)))
    return wall, cpu, min(statistics.mean(r["peak"]) for r in ranks)


def predict(world: int, overrides: list[str], mfu: float, link, peak_tflops: float | None = None):
    from megaloop.config import load_config
    from megaloop.plan.comm import Cluster, DpComm
    from megaloop.plan.search import Planner
    from megaloop.plan.time_cli import job_gpu
    from megaloop.plan.time_model import device_for

    cfg = load_config(REPO / CONFIG, MODEL + overrides, world_size=world)
    # the runtime's buckets (the config's parallel.grad_buckets and bucket size), the all-gather behind the forward
    planner = Planner(job_gpu("cpu"), world, device_for("cpu", "fp32", mfu, peak_tflops), Cluster(world, link, link),
                      DpComm(), None)
    return planner.estimate(cfg).time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=sorted(LAYOUTS), default=list(LAYOUTS))
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--mfu", type=float, default=1.0, help="efficiency on the CPU's matmul peak (default 1.0)")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)  # the planner's cpu peak is looked up for this process's thread count
    from megaloop.train.peak import cpu_peak

    peak = cpu_peak("fp32")
    cpu_peak("bf16")  # Muon's Polar Express runs in bf16 where the CPU computes it natively
    link = probe_gloo()
    print(f"cpu peak {peak.tflops * 1e3:.1f} GFLOP/s fp32, one thread ({peak.source}); efficiency {a.mfu}")
    print("gloo on localhost, per collective: " + "; ".join(
        f"{kind} {bw / 1e9:.2f} GB/s, {lat * 1e6:.0f} us per ring step" for kind, bw, lat in link.kinds))
    print("cached: the prediction at the cached peaks; now: at the peak the ranks measured beside their steps "
          "(under the same load as the steps); wall: the measured step; cpu: the slowest rank's CPU time in it "
          "(on a shared machine the fairest figure for one process; it leaves out waits: comm, bubbles)")
    print(f"{'layout':<8}{'comm s':>8}{'optim s':>8}{'cached s':>9}{'peak now':>9}{'now s':>8}{'wall s':>8}"
          f"{'cpu s':>8}{'cached/wall':>12}{'now/wall':>9}{'busy/cpu':>9}")
    measured = {}
    for name in a.only:
        world, overrides = LAYOUTS[name]
        cached = predict(world, overrides, a.mfu, link)
        wall, cpu, peak_now = measured[name] = measure(world, overrides, a.warmup, a.steps)
        now = predict(world, overrides, a.mfu, link, peak_now)
        print(f"{name:<8}{now.exposed_comm_s:>8.3f}{now.optimizer_s:>8.3f}{cached.step_time_s:>9.3f}"
              f"{peak_now * 1e3:>9.1f}{now.step_time_s:>8.3f}{wall:>8.3f}{cpu:>8.3f}"
              f"{cached.step_time_s / wall:>12.2f}{now.step_time_s / wall:>9.2f}{cached.busy_s / cpu:>9.2f}",
              flush=True)
    if "1" in measured:
        calibrated(measured, a.mfu, link)


def calibrated(measured: dict, mfu: float, link) -> None:
    """The efficiency that makes the one-process prediction equal its CPU time, then every layout at it."""
    one = predict(1, [], mfu, link)
    eff = mfu * one.busy_s / measured["1"][1]
    print(f"efficiency from layout 1's CPU time: {eff:.3f} of the cached peaks")
    print("busy: the predicted compute of the busiest rank alone (no comm, no pipeline bubbles), what its CPU time "
          "measures")
    print(f"{'layout':<8}{'predicted s':>12}{'busy s':>8}{'wall s':>8}{'cpu s':>8}{'pred/wall':>10}{'busy/cpu':>9}")
    for name, (wall, cpu, _) in measured.items():
        world, overrides = LAYOUTS[name]
        t = predict(world, overrides, min(eff, 1.0), link)
        print(f"{name:<8}{t.step_time_s:>12.3f}{t.busy_s:>8.3f}{wall:>8.3f}{cpu:>8.3f}{t.step_time_s / wall:>10.2f}"
              f"{t.busy_s / cpu:>9.2f}", flush=True)


if __name__ == "__main__":
    main()
