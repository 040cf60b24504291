"""`python -m megaloop preflight [--nproc-per-node N]`: every communication path of a job on this machine (gloo on
CPU, NCCL on GPUs), or, started by a launcher (torchrun, srun: `python -m slurm preflight`), on its whole world.

Exit code: 0 when every path passed, 3 when one failed (PASS/FAIL per path above it), 2 for a bad option, 1 when an
error stopped it."""
from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from data_prep.paths import LocalPath

HELP = ("run every communication path (tp2 x dp and pp2 x dp training steps against one process, the ring pipeline "
        "with parcae-1_3b-sized messages, ZeRO-1 reduce-scatter/all-gather, distributed Muon, a dp checkpoint saved "
        "and resumed) and print PASS/FAIL with the measured bus bandwidth of each")


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from megaloop.preflight.worker import PATHS

    p.add_argument("--nproc-per-node", type=int, metavar="N",
                   help="processes to start on this machine, an even number (default: one per GPU, or 4 on CPU); "
                        "ignored when a launcher started this command")
    p.add_argument("--only", default=",".join(PATHS), metavar="PATH[,PATH]",
                   help=f"run these paths only, in this order (default: all: {','.join(PATHS)})")
    p.add_argument("--json", action="store_true", help="also print the results as one JSON line at the end")
    p.add_argument("--work-dir", type=LocalPath(), help="folder for the data and the runs' checkpoints, readable by "
                   "every node (default: a temporary folder, removed afterwards)")
    p.add_argument("--keep", action="store_true", help="keep the temporary folder")
    p.add_argument("--min-bw-fraction", type=float, default=0.0, metavar="F",
                   help="also fail a path whose bus bandwidth is below F x the link's nominal rate, where known "
                        "(default 0: bandwidth is reported only)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA (NCCL) when there are GPUs, else CPU (gloo)")
    p.add_argument("--timeout", type=float, default=300.0, metavar="S",
                   help="a collective waiting longer than this fails the preflight instead of hanging (default 300)")
    return p


EXIT_CODES = ("Exit code 0: every path passed; 3: a path failed (FAIL in its line); 2: a bad option; 1: an error "
              "stopped the preflight")


def check_arguments(args) -> None:
    from megaloop.config import ConfigError
    from megaloop.preflight.worker import PATHS

    args.only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = [name for name in args.only if name not in PATHS]
    if unknown or not args.only:
        raise ConfigError("--only", ",".join(unknown) or "(empty)", f"choose from {','.join(PATHS)}")
    if args.nproc_per_node is not None and (args.nproc_per_node < 2 or args.nproc_per_node % 2):
        raise ConfigError("--nproc-per-node", args.nproc_per_node, "must be even and >= 2 (tp2 and pp2 pairs)")
    if not 0.0 <= args.min_bw_fraction <= 1.0:
        raise ConfigError("--min-bw-fraction", args.min_bw_fraction, "must be in [0, 1]")
    if not args.timeout > 0:
        raise ConfigError("--timeout", args.timeout, "must be > 0 seconds")


def run_preflight(args) -> int:
    from megaloop.preflight.worker import launched, run_worker

    check_arguments(args)
    if launched():
        return run_worker(args)
    return launch(args)


def default_nproc(device: str) -> int:
    import torch

    gpus = torch.cuda.device_count() if device != "cpu" else 0
    return gpus - gpus % 2 if gpus >= 2 else 4


def worker_argv(args) -> list[str]:
    argv = ["--only", ",".join(args.only), "--min-bw-fraction", str(args.min_bw_fraction), "--device", args.device,
            "--timeout", str(args.timeout)]
    argv += ["--json"] if args.json else []
    argv += ["--keep"] if args.keep else []
    return argv + (["--work-dir", args.work_dir] if args.work_dir else [])


# A CPU worker's peak resident memory is ~0.9 GB (measured with 2 workers: every path, the 1.3B-shaped ring
# messages included); more than 2 one-thread workers per core make the collectives time out instead of measuring.
WORKER_MEMORY_GB = 1.0
PROCESSES_PER_CORE = 2


def available_memory_gb() -> float:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), in GB; inf where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / 1e9
    except (OSError, ValueError, IndexError):
        pass
    return float("inf")


def check_local_fit(nproc: int, cores: int, memory_gb: float) -> None:
    """N CPU workers on this machine: refused (a config error naming a size that fits) when they need more memory
    than is available or more than PROCESSES_PER_CORE per available core."""
    from megaloop.config import ConfigError

    fits = int(min(PROCESSES_PER_CORE * cores, memory_gb // WORKER_MEMORY_GB))
    fits -= fits % 2
    if nproc <= fits:
        return
    need = nproc * WORKER_MEMORY_GB
    advice = f"use --nproc-per-node {fits} or fewer" if fits >= 2 else "this machine cannot run the preflight"
    raise ConfigError("--nproc-per-node", nproc, f"{nproc} CPU workers need about {need:.0f} GB of memory "
                      f"({WORKER_MEMORY_GB:.0f} GB each) and at least {-(-nproc // PROCESSES_PER_CORE)} cores (at "
                      f"most {PROCESSES_PER_CORE} workers per core), and this machine has {memory_gb:.1f} GB "
                      f"available and {cores} core(s); {advice}")


def launch(args) -> int:
    """torchrun's agent in this process (--standalone) running this command on N workers; the workers print. The
    work folder is made here and removed here on every exit (unless --keep or --work-dir)."""
    nproc = args.nproc_per_node or default_nproc(args.device)
    if args.device == "cpu" or not _cuda_available():
        from megaloop.train.peak import available_cores

        check_local_fit(nproc, available_cores(), available_memory_gb())
    if args.work_dir:
        return _launch(args, nproc)
    import shutil
    import tempfile

    work = tempfile.mkdtemp(prefix="megaloop-preflight-")
    args.work_dir = work
    try:
        return _launch(args, nproc)
    finally:
        if args.keep:
            print(f"megaloop preflight: kept the work folder {work}", file=sys.stderr, flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _launch(args, nproc: int) -> int:
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from megaloop.preflight.worker import FAILED_EXIT_CODE

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(
        lambda record: f"exitcode: {FAILED_EXIT_CODE})" not in record.getMessage())
    sys.stdout.flush()
    try:
        run(parse_args(["--standalone", "--nproc-per-node", str(nproc), "-m", "megaloop", "preflight",
                        *worker_argv(args)]))
    except ChildFailedError as err:
        codes = sorted({failure.exitcode for failure in err.failures.values()})
        # the agent ends the other workers (SIGTERM) as soon as the first one exits: they had all finished
        if FAILED_EXIT_CODE in codes and set(codes) <= {FAILED_EXIT_CODE, -signal.SIGTERM}:
            print("megaloop preflight: FAILED (see the paths marked FAIL above)", file=sys.stderr, flush=True)
            return FAILED_EXIT_CODE
        print(f"megaloop preflight: a worker stopped with an error (exit codes {codes}; the error is above)",
              file=sys.stderr, flush=True)
        return 1
    return 0
