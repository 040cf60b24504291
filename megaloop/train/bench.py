"""`python -m megaloop bench CONFIG [--steps N] [--warmup W] [--nproc-per-node P] [--set ...]`: train W + N steps
(the trainer itself: one process, or P through `megaloop launch`), then a table of the N measured steps from the
run's metrics.jsonl, and a PNG of the same.

Definitions (per second of the measured steps' wall time, summed over the job's processes):
  useful TFLOP/s     the FLOP model at each sequence's own depth (n_i laps without, k_i with gradient)
  executed TFLOP/s   at the depths that ran (a micro-batch runs its deepest sequence's laps on every row)
  hardware TFLOP/s   executed plus the forwards recomputed under train.activation_checkpointing (one more forward
                     of every lap with gradient; k = min(executed depth, backprop depth) per sequence)
  MFU                useful / the dense bf16 peak of the job's devices; beside it useful / the FP8 peak (what the
                     same devices could reach with every matmul in FP8), and useful / the peak of the run's precision
                     (fp32 runs get a number, against the fp32 peak). On CPU every peak is this machine's measured
                     matmul rate in that dtype (FP8: torch._scaled_mm), cached as `python -m megaloop peak` shows.
Step split (rank 0's mean per step): data (waiting for the batch), forward, backward (summed over micro-batches),
exposed communication (the gradient reduction's wait after the backward), optimizer, pipeline idle (a stage waiting
for its neighbours' messages; on a GPU the pipeline's ring run is reported whole as forward), other (the rest: the
step's statistics reduction, host work). A GPU's phase times are read one step late (CUDA events, never waited
for: train record s holds step s-1's, named by its time_phases_step), so the split covers the measured steps whose
phases a later record reports (all but the last there) and sets each beside that same step's wall time and data wait.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from data_prep.paths import LocalPath

HELP = ("measure training throughput: N steps after a warm-up, then tokens/s, useful/executed/hardware TFLOP/s, MFU "
        "against the bf16 and FP8 dense peaks, and the step split into data, forward, backward, communication, "
        "optimizer and pipeline idle, as a table and a PNG")
SPLIT = ("data", "forward", "backward", "communication", "optimizer", "pipeline_idle", "other")


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--steps", type=int, default=10, metavar="N", help="measured steps (default 10)")
    p.add_argument("--warmup", type=int, default=2, metavar="W", help="steps run first and not measured (default 2)")
    p.add_argument("--nproc-per-node", type=int, default=1, metavar="P",
                   help="processes (default 1: in this process; more: through `megaloop launch`, torchrun)")
    p.add_argument("--out-dir", type=LocalPath(), default=None,
                   help="the run's directory (default: a new temporary one)")
    p.add_argument("--png", default=None, help="where to write the plot (default: <out-dir>/bench.png)")
    p.add_argument("--json", action="store_true", help="also print the figures as one JSON object")
    return p


@dataclass
class BenchFigures:
    steps: int
    world: int
    precision: str
    tokens_per_s: float
    useful_tflops: float
    executed_tflops: float
    hardware_tflops: float
    peaks: dict  # label -> job TFLOP/s
    peak_sources: dict
    mfu: dict  # label -> useful / peak
    split_s: dict  # SPLIT name -> mean seconds per step, over split_steps of the measured steps
    step_s: float  # their mean wall time
    split_steps: int


def summarise(records: list[dict], cfg, world: int, precision: str, peaks: dict, sources: dict,
              later: list[dict] = ()) -> BenchFigures:
    """The figures of the measured steps' train records; peaks: label -> the job's TFLOP/s. later: the train
    records after them (none in a bench run, which ends with its last measured step), read only for phase times."""
    from megaloop.train.flops import FlopModel

    m = cfg.model
    fm = FlopModel.of(m)
    wall = sum(r["time_step"] for r in records)
    tokens = sum(r["tokens"] for r in records)
    useful = sum(r["useful_flops"] for r in records)
    executed = sum(r["executed_flops"] for r in records)
    k = min(m.backprop_depth, max(r["executed_depth"] for r in records)) if m.is_looped else 0
    recompute = tokens * fm.recompute_per_token(k, cfg.train.activation_checkpointing)
    split, step, paired = step_split(records, [*records, *later])
    rate = useful / wall / 1e12
    return BenchFigures(len(records), world, precision, tokens / wall, rate, executed / wall / 1e12,
                        (executed + recompute) / wall / 1e12, peaks, sources,
                        {label: rate / p if p and math.isfinite(p) else float("nan") for label, p in peaks.items()},
                        split, step, paired)


def step_split(measured: list[dict], reporting: list[dict]) -> tuple[dict, float, int]:
    """(SPLIT name -> mean seconds, mean step seconds, steps) over the measured steps whose phase times one of
    `reporting` holds (time_phases_step; records without it report their own step's): each step's phases beside
    its own wall time and data wait, never a neighbour's. NaN times (a GPU's first step) count as 0."""
    phases_of = {r.get("time_phases_step", r["step"]): r for r in reporting}
    paired = [(r, phases_of[r["step"]]) for r in measured if r["step"] in phases_of]
    if not paired:
        return dict.fromkeys(SPLIT, float("nan")), float("nan"), 0
    n = len(paired)
    split = {"data": sum(_finite(r.get("time_data", 0.0)) for r, _ in paired) / n}
    for name in SPLIT[1:-1]:
        split[name] = sum(_finite(p.get(f"time_{name}", 0.0)) for _, p in paired) / n
    step = sum(r["time_step"] for r, _ in paired) / n
    split["other"] = max(0.0, step - sum(split.values()))
    return split, step, n


def _finite(x) -> float:
    return x if isinstance(x, (int, float)) and math.isfinite(x) else 0.0


def job_peaks(device_type: str, precision: str, world: int, threads: int) -> tuple[dict, dict]:
    """label -> the job's dense peak for bf16, fp8 and the run's precision: one device's times world; on CPU the
    measured (cached) matmul rate on `threads` threads, each label against the best of its precision and the wider
    ones (peak.best_peak: an emulated FP8 "peak" below bf16's is not a peak), times the share of the cores the
    world's processes get (peak.core_share)."""
    import torch

    from megaloop.train.peak import best_peak, core_share, cpu_peak, gpu_peak

    labels = {"bf16": "bf16 dense", "fp8": "FP8 dense"}
    if precision not in labels:
        labels[precision] = f"{precision} (the run's precision)"
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if device_type == "cuda":
            chosen = {prec: gpu_peak(torch.cuda.get_device_name(), prec) for prec in labels}
            share = 1.0
        else:
            measured = {prec: cpu_peak(prec) for prec in {*labels, "fp32"}}
            chosen = {prec: best_peak(prec, measured) for prec in labels}
            share = core_share(world, threads)
    finally:
        torch.set_num_threads(before)
    peaks = {labels[prec]: p.tflops * world * share for prec, p in chosen.items()}
    shared = "" if share == 1 else f" (x {share:.3g}: {world} processes x {threads} threads share the cores)"
    sources = {labels[prec]: p.source + shared for prec, p in chosen.items()}
    return peaks, sources


def format_table(f: BenchFigures, title: str) -> str:
    lines = [title, f"{'measured steps':<34} {f.steps} (rank 0's times; {f.world} process(es), precision "
                    f"{f.precision})",
             f"{'tokens/s':<34} {f.tokens_per_s:,.1f}",
             f"{'useful TFLOP/s':<34} {f.useful_tflops:.5f}",
             f"{'executed TFLOP/s':<34} {f.executed_tflops:.5f}",
             f"{'hardware TFLOP/s (with recompute)':<34} {f.hardware_tflops:.5f}"]
    for label, peak in f.peaks.items():
        mfu = f.mfu[label]
        shown = "n/a" if not math.isfinite(mfu) else f"{100 * mfu:.2f}%"
        lines.append(f"{'MFU vs ' + label + ' peak':<34} {shown:>8}  (peak {peak:.4g} TFLOP/s: "
                     f"{f.peak_sources[label]})")
    whose = "every measured step" if f.split_steps == f.steps else \
        f"{f.split_steps} of the {f.steps} measured steps: the last one's GPU times are read after the run"
    lines.append(f"{'step (mean)':<34} {1e3 * f.step_s:.1f} ms  ({whose})")
    for name in SPLIT:
        s = f.split_s[name]
        share = f"{100 * s / f.step_s:6.1f}%" if f.split_steps else "    n/a"
        lines.append(f"  {name.replace('_', ' '):<32} {1e3 * s:9.1f} ms {share}")
    return "\n".join(lines)


def write_png(f: BenchFigures, title: str, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.6))
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)
    rates = {"useful": f.useful_tflops, "executed": f.executed_tflops, "hardware": f.hardware_tflops}
    left.bar(list(rates), list(rates.values()), color=["tab:green", "tab:blue", "tab:gray"])
    left.set_ylabel("TFLOP/s")
    left.set_title(f"{f.tokens_per_s:,.0f} tokens/s; " + ", ".join(
        f"MFU {label.split()[0]} {100 * v:.1f}%" for label, v in f.mfu.items() if math.isfinite(v)), fontsize=8)
    bottom = 0.0
    for name in SPLIT:
        value = 1e3 * f.split_s[name]
        right.bar(["step"], [value], bottom=bottom, label=f"{name.replace('_', ' ')} {value:.0f} ms")
        bottom += value
    right.set_ylabel("ms per step")
    right.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def _train(args, sets: list[str], cfg) -> int:
    if args.nproc_per_node == 1:
        from megaloop.train.cli import run_training

        return run_training(cfg)
    import subprocess

    cmd = [sys.executable, "-m", "megaloop", "launch", "--nproc-per-node", str(args.nproc_per_node), args.config]
    return subprocess.run(cmd + [a for s in sets for a in ("--set", s)]).returncode


def run_bench(args) -> int:
    import tempfile

    import torch

    from megaloop.config import ConfigError, load_config

    for name in ("steps", "nproc_per_node"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}", getattr(args, name), "must be >= 1")
    if args.warmup < 0:
        raise ConfigError("--warmup", args.warmup, "must be >= 0")
    out = Path(args.out_dir or tempfile.mkdtemp(prefix="megaloop-bench-"))
    world = args.nproc_per_node
    device = _device(load_config(args.config, list(args.overrides), world_size=world, validate=False))
    end = args.warmup + args.steps
    total = end + (1 if device == "cuda" else 0)  # a GPU's phase times of step s are read at step s + 1
    sets = list(args.overrides) + [f"train.steps={total}", f"train.out_dir={out}", "data.val_batches=0",
                                   f"train.val_every={total}", "train.log_every=1", "checkpoint.every=0",
                                   "train.wandb=''"]  # a measurement, not a run to log to W&B
    cfg = load_config(args.config, sets, world_size=world)
    if (out / "metrics.jsonl").exists():
        raise ConfigError("--out-dir", str(out), "already holds a run; give a new directory")
    threads = torch.get_num_threads() if world == 1 else int(os.environ.get("OMP_NUM_THREADS", "1"))
    code = _train(args, sets, cfg)
    if code != 0:
        return code
    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r.get("kind") == "train"]
    summary = json.loads((out / "summary.json").read_text())
    peaks, sources = job_peaks(device, summary["precision"], world, threads)
    figures = summarise([r for r in train if args.warmup <= r["step"] < end], cfg, world, summary["precision"], peaks,
                        sources, later=[r for r in train if r["step"] >= end])
    tp, pp = cfg.parallel.tp, cfg.parallel.pp
    layout = f"tp={tp}, pp={pp}, dp={world // (tp * pp)}"
    title = f"megaloop bench {Path(args.config).stem} ({layout}; {world} process(es) on {device})"
    print(format_table(figures, title))
    png = Path(args.png) if args.png else out / "bench.png"
    write_png(figures, title, png)
    print(f"plot: {png}")
    if args.json:
        print(json.dumps({"config": args.config, **asdict(figures)}))
    return 0


def _device(cfg) -> str:
    import torch

    return "cuda" if cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available()) else "cpu"
