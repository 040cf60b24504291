"""Data-parallel gradient traffic that overlaps: the gradient buffer's bucket order before (parallel.grad_buckets=
columns) and after (backward), structurally, measured on CPU, and as the time planner predicts it.

    python benchmarks/dp_exposed.py [--dps 2 4] [--steps 6] [--skip-structure] [--skip-measure]

1. Structure, parcae-140m at dp 2 (fp32, ZeRO-1, one micro-batch of one 64-token row per rank, fixed depth): one
   real training step per layout; the fraction of the gradient bytes whose reduction was launched while backward
   still had gradients to finish (BufferReducer.last_overlap: launched before the backward's last
   post-accumulate-grad hook), beside the share of the parameters that are not embeddings, and what the planner's
   buckets (megaloop/plan/dp_buckets.py) give for it: the elements of the buckets that hold no lookup's columns
   (the measured figure can be higher: the value embeddings' hooks fire before the tied embedding's).
2. Measured, gloo on localhost, one thread per process: a CPU-sized model (plan_time_accuracy's d 512 model at seq
   64, one row per rank per step, so that the traffic weighs in the step; buckets of 2M elements, so that the 15M
   parameters make several, as parcae-1_3b's do at dp 128) at each dp, both layouts in turn in fresh processes. Per step: the wall time (a barrier before it, the slowest rank's), and the exposed communication:
   what reduce_gradients waits for after the backward plus what the training thread spends in the parameter
   all-gather's calls (launching, waiting in the forward). Medians over --steps after one warm-up step.
   Beside it, the planner's prediction for the same layout: the "cpu" device at the efficiency that makes the one-
   process step equal its measured CPU time, and gloo fitted per collective by plan_time_accuracy's probe (its calls
   sit between matmuls, as a tp step's do; the reduction's buckets go back to back after the backward, which gloo
   runs faster). "calibrated": the probe's link with every time scaled so that the columns layout's prediction
   equals its measurement at that dp (nothing of it overlaps: all its buckets wait for the end of backward), then
   the backward layout predicted with that link: the check of the overlap model itself.

Run it on an idle machine with at least max(--dps) + 1 cores: on fewer, the ranks' compute and gloo's threads share
cores, and nothing can overlap.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.plan_time_accuracy import MODEL, _env, _free_port, probe_gloo  # noqa: E402

LAYOUTS = ("columns", "backward")
SMALL = [o for o in MODEL if not o.startswith(("model.seq_len", "data."))] + [
    "model.seq_len=64", "data.micro_batch_size=1", "parallel.grad_bucket_elements=2000000"]
STRUCTURE = ["model.depth_sampler=fixed", "model.seq_len=64", "train.precision=fp32", "train.progress=false",
             "data.micro_batch_size=1"]


def _overrides(base: list[str], dp: int, order: str) -> list[str]:
    return [*base, f"parallel.dp={dp}", f"data.global_batch_size={dp}", f"parallel.grad_buckets={order}"]


def _rank(rank: int, world: int, port: int, config: str, overrides: list[str], warmup: int, steps: int,
          out_dir: str) -> None:
    _env(rank, world, port)
    import time

    import torch
    import torch.distributed as dist

    from megaloop.config import load_config
    from megaloop.depth import make_sampler
    from megaloop.train.flops import FlopModel
    from megaloop.train.loop import build_model_and_optimizer
    from megaloop.train.runtime import make_runtime
    from megaloop.train.step import train_step

    torch.set_num_threads(1)
    cfg = load_config(REPO / config, overrides, world_size=world)
    m, device = cfg.model, torch.device("cpu")
    runtime = make_runtime(cfg, device)
    rows = cfg.data.global_batch_size // world
    sampler = make_sampler("fixed", m.mu_rec, m.backprop_depth, seed=0)
    model, optimizer = build_model_and_optimizer(cfg, runtime, device)
    gather = optimizer.parts.gather
    gen = torch.Generator().manual_seed(runtime.dp_rank)
    walls, exposed, early = [], [], []
    for step in range(warmup + steps):
        index = torch.arange(rows) + runtime.dp_rank * rows + step * cfg.data.global_batch_size
        batch = {"tokens": torch.randint(0, m.vocab_size, (rows, m.seq_len + 1), generator=gen),
                 "sample_index": index}
        dist.barrier()
        before, t0 = gather.busy_s if gather else 0.0, time.perf_counter()
        stats = train_step(model, optimizer, batch, sampler.sample(step, index), step, 0, cfg, runtime,
                           FlopModel.of(m))
        wall = time.perf_counter() - t0
        if step >= warmup:
            walls.append(wall)
            exposed.append(stats.times["communication"] + ((gather.busy_s - before) if gather else 0.0))
            early.append(runtime.reducer.last_overlap.early_fraction)
    runtime.finish_param_gather()
    groups = [{"late": g.late, "elements": g.chunk_len * g.dp} for g in runtime.buffer.groups]
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
        {"wall": walls, "exposed": exposed, "early": early, "groups": groups,
         "params": {n: p.numel() for n, p in model.named_parameters()}}))
    runtime.close()


def run(world: int, config: str, overrides: list[str], warmup: int, steps: int) -> list[dict]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank, args=(world, _free_port(), config, overrides, warmup, steps, out_dir), nprocs=world,
                 join=True)
        return [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("rank*.json"))]


def structure() -> None:
    from megaloop.config import load_config
    from megaloop.plan.dp_buckets import planned_buckets
    from megaloop.plan.layout import local_params

    config = "configs/parcae-140m.yaml"
    cfg = load_config(REPO / config, STRUCTURE)
    params = local_params(cfg, 1)
    plain = sum(p.local_numel for p in params if not p.lookup) / sum(p.local_numel for p in params)
    print(f"parcae-140m, dp 2, ZeRO-1 fp32: {plain:.1%} of the parameters are not embeddings")
    print(f"{'layout':<10}{'launched before backward ends':>31}{'planned':>9}{'buffer (elements)':>19}")
    for order in LAYOUTS:
        ranks = run(2, config, _overrides(STRUCTURE, 2, order), 0, 1)
        planned = planned_buckets(params, 2, 1, True, 40_000_000, order, cfg.model.mu_rec, cfg.model.backprop_depth)
        early = sum(b.elements for b in planned if not b.lookups) / sum(b.elements for b in planned)
        size = sum(g["elements"] for g in ranks[0]["groups"])
        print(f"{order:<10}{min(r['early'][0] for r in ranks):>31.1%}{early:>9.1%}{size:>19,}", flush=True)


def measured(dps: list[int], steps: int) -> None:
    import torch

    from benchmarks.plan_time_accuracy import CONFIG, measure, predict

    torch.set_num_threads(1)
    from megaloop.train.peak import cpu_peak

    cpu_peak("fp32")
    cpu_peak("bf16")
    link = probe_gloo()
    print("\ngloo on localhost, per collective: " + "; ".join(
        f"{kind} {bw / 1e9:.2f} GB/s, {lat * 1e6:.0f} us" for kind, bw, lat in link.kinds))
    one = _overrides(SMALL, 1, "backward")
    _, cpu, _ = measure(1, one, 1, steps)
    eff = min(1.0, predict(1, one, 1.0, link).busy_s / cpu)
    print(f"one process: {cpu:.3f} s of CPU per step -> efficiency {eff:.3f} of the cached fp32 peak")
    print(f"{'dp':>3} {'layout':<9}{'step s':>8}{'exposed s':>10}{'measured':>9}{'predicted':>10}{'pred/meas':>10}"
          f"{'calibrated':>11}{'cal/meas':>9}{'early':>7}")
    for dp in dps:
        scale = None
        for order in LAYOUTS:
            overrides = _overrides(SMALL, dp, order)
            ranks = run(dp, CONFIG, overrides, 1, steps)
            walls = [max(ws) for ws in zip(*(r["wall"] for r in ranks))]
            exposed = [max(es) for es in zip(*(r["exposed"] for r in ranks))]
            wall, hidden = statistics.median(walls), statistics.median(exposed)
            t = predict(dp, overrides, eff, link)
            if scale is None:  # the columns layout: nothing overlaps, so its measurement times the link
                scale = hidden / t.dp_exposed_s
            c = predict(dp, overrides, eff, scaled(link, scale))
            fraction, measured_fraction, cal = t.dp_exposed_s / t.step_time_s, hidden / wall, c.dp_exposed_s / wall
            print(f"{dp:>3} {order:<9}{wall:>8.3f}{hidden:>10.3f}{measured_fraction:>9.1%}{fraction:>10.1%}"
                  f"{fraction / measured_fraction:>10.2f}{cal:>11.1%}{cal / measured_fraction:>9.2f}"
                  f"{min(r['early'][-1] for r in ranks):>7.1%}", flush=True)
        print(f"    (link times x {scale:.3f} for the calibrated column)")


def scaled(link, factor: float):
    """`link` with every time multiplied by `factor` (latencies x factor, bandwidths / factor)."""
    from megaloop.plan.comm import Link

    return Link(link.bandwidth / factor, link.latency * factor,
                tuple((k, bw / factor, lat * factor) for k, bw, lat in link.kinds))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dps", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--skip-structure", action="store_true")
    ap.add_argument("--skip-measure", action="store_true")
    a = ap.parse_args()
    if not a.skip_structure:
        structure()
    if not a.skip_measure:
        measured(a.dps, a.steps)


if __name__ == "__main__":
    main()
