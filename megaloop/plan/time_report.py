"""The time plan as text: one layout's step breakdown, and the ranked layouts of a search."""
from __future__ import annotations

from megaloop.plan.comm import Cluster, DpComm
from megaloop.plan.run_length import RunLength
from megaloop.plan.search import Estimate
from megaloop.plan.time_model import Device


def assumptions(device: Device, cluster: Cluster, comm: DpComm) -> list[str]:
    i, o = cluster.intra, cluster.inter
    buckets = "fixed 25 MiB" if comm.buckets == "fixed" else "max(40M, 1M x dp) elements"
    return [
        f"  device {device.name}: dense peak {device.peak_tflops:.4g} TFLOP/s at efficiency {device.efficiency:g} "
        f"-> {device.rate / 1e12:.4g} TFLOP/s per GPU" + (
            f"; FP8 GEMMs (train.fp8) at the FP8 peak {device.fp8_tflops:.4g} TFLOP/s x {device.efficiency:g}"
            if device.fp8_tflops else ""),
        f"  links: intra-node {i.bandwidth / 1e9:g} GB/s, {i.latency * 1e6:g} us per ring step; inter-node "
        f"{o.bandwidth / 1e9:g} GB/s per GPU, {o.latency * 1e6:g} us ({cluster.gpus_per_node} GPUs per node)",
        f"  data-parallel buckets {buckets}; parameter all-gather "
        f"{'overlapped with the next forward' if comm.overlap_param_gather else 'exposed'}",
    ]


def time_lines(est: Estimate, run: RunLength, device: Device, cluster: Cluster, comm: DpComm) -> list[str]:
    t = est.time
    ms = 1e3
    lines = ["", "time plan, one optimizer step on the busiest rank:", *assumptions(device, cluster, comm),
             f"  compute {t.compute_s * ms:.1f} ms" + (f" (pipeline makespan, idle {t.pipeline_idle:.3f})"
                                                       if est.plan.layout.pp > 1 else "")
             + f", optimizer {t.optimizer_s * ms:.1f} ms",
             f"  exposed communication: tp {t.tp_s * ms:.1f} ms, pp {t.pp_s * ms:.1f} ms, dp {t.dp_exposed_s * ms:.1f} "
             f"ms (reduction {t.dp.reduce_s * ms:.1f} ms, {t.dp.reduce_exposed_s * ms:.1f} ms of it past the backward; "
             f"all-gather {t.dp.gather_s * ms:.1f} ms, {t.dp.gather_exposed_s * ms:.1f} ms of it waited for in the "
             f"forward; {t.dp.calls} calls, parallel.grad_buckets={est.plan.cfg.parallel.grad_buckets}) "
             f"-> {t.exposed_comm_fraction:.1%} of the step",
             f"  step {t.step_time_s:.3f} s, {t.tokens_per_step} tokens: {t.tokens_per_s:,.0f} tokens/s, "
             f"{t.tokens_per_day / 1e9:.2f}B tokens/day",
             run.line(t.step_time_s, est.plan.layout.world, device.name),
             f"  peak {est.peak_bytes / 2**30:.2f} GiB per GPU ({'fits' if est.fits else 'does NOT fit'})"]
    return lines


def ranking_lines(found: list[Estimate], run: RunLength, top: int) -> list[str]:
    """The fastest layouts, with the days and GPU-hours of the whole run (`run`) on each."""
    head = (f"{'#':>3} {'tp':>3} {'pp':>3} {'dp':>4} {'mb':>4} {'ckpt':>5} {'wire':>5} {'step s':>8} "
            f"{'tokens/s':>11} {'days':>7} {'GPU-h':>9} {'exposed':>8} {'peak GiB':>9}")
    lines = [f"  the run: {run.steps:,} steps of {run.tokens_per_step:,} tokens ({run.source})", head]
    for n, e in enumerate(found[:top], 1):
        lay, t = e.layout(), e.time
        lines.append(f"{n:3d} {lay['tp']:3d} {lay['pp']:3d} {lay['dp']:4d} {lay['micro_batch']:4d} "
                     f"{lay['activation_checkpointing']:>5} {lay['grad_reduce_dtype']:>5} {t.step_time_s:8.3f} "
                     f"{t.tokens_per_s:11,.0f} {run.days(t.step_time_s):7.2f} "
                     f"{run.gpu_hours(t.step_time_s, e.plan.layout.world):9,.0f} {t.exposed_comm_fraction:8.1%} "
                     f"{e.peak_bytes / 2**30:9.2f}")
    return lines
