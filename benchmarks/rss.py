"""Resident-set readings for the memory benchmarks that run each layout in its own processes (Linux /proc).

MEASURE_ENV is the environment of those processes: glibc returns every freed block above 64 KiB to the kernel at
once (so the resident set follows live tensors) and torch runs one thread per process.
"""
from __future__ import annotations

import os

MEASURE_ENV = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}


def status_mb(field: str) -> float:
    """A /proc/self/status field in MiB (VmRSS: resident now; VmHWM: peak since the last reset_peak)."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"/proc/self/status has no {field}")


def reset_peak() -> None:
    """Reset the kernel's peak mark (VmHWM) to the current resident set."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def process_counts(text: str) -> list[int]:
    """argparse type for a comma-separated list of process counts ("1,2,4"), each >= 1."""
    import argparse

    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated integers, e.g. 1,2,4") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: every count must be >= 1")
    return counts
