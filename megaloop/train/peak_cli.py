"""`python -m megaloop peak [--refresh] [--precision P] [--threads N] [--json]`: the CPU peak that MFU divides by,
as cached for this machine (measured now where it is missing), and what train.precision=auto picks here."""
from __future__ import annotations

import argparse
import json

HELP = ("show the CPU matmul peak that MFU divides by, per precision, from this machine's cache (measuring what is "
        "missing, about 2 s each), and what train.precision=auto picks here")


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--refresh", action="store_true", help="re-measure and replace the cached values (do it on an "
                   "idle machine: a busy one measures low)")
    p.add_argument("--precision", choices=("all", "bf16", "fp32", "fp8", "fp64"), default="all",
                   help="which precision (default: all four)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch threads to measure with (default: torch's default here; a training process under "
                   "torchrun uses OMP_NUM_THREADS, 1 unless set)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run_peak(args) -> int:
    import torch

    from megaloop.config import ConfigError
    from megaloop.train.hardware import cpu_bf16_support, cpu_isa, cpu_name
    from megaloop.train.peak import PeakCache, best_peak, cpu_peak

    if args.threads is not None:
        if args.threads < 1:
            raise ConfigError("--threads", args.threads, "must be >= 1")
        torch.set_num_threads(args.threads)
    names = ("fp32", "bf16", "fp8", "fp64") if args.precision == "all" else (args.precision,)
    measured = {name: cpu_peak(name, refresh=args.refresh) for name in dict.fromkeys((*names, "bf16", "fp32"))}
    peaks = {name: best_peak(name, measured) for name in names}
    support = cpu_bf16_support()
    info = {"cpu": cpu_name(), "isa": cpu_isa(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "cache": str(PeakCache().path), "auto": "bf16" if support.native else "fp32", "auto_why": support.why,
            "peaks_tflops": {n: p.tflops for n, p in peaks.items()},
            "sources": {n: p.source for n, p in peaks.items()}}
    if args.json:
        print(json.dumps(info))
        return 0
    print(f"CPU {info['cpu']} ({info['isa']}), {info['threads']} thread(s), torch {info['torch']}")
    print(f"train.precision=auto runs {info['auto']} here: {support.why}")
    print("the peak MFU divides by for each precision (the best of it and the wider ones: a slower emulated one is "
          "not a peak); bench and train use these")
    print(f"{'precision':<10} {'TFLOP/s':>9}  source")
    for name, p in peaks.items():
        print(f"{name:<10} {p.tflops:>9.4f}  {p.source}")
    return 0
