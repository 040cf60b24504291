"""Time from `python -m megaloop train` to its first optimizer step, with a cold and a warm CPU-peak cache, beside
another checkout (e.g. one from before the peak was cached) run the same way, side by side in one run.

    python benchmarks/startup.py --shards SHARD_DIR [--before CHECKOUT_DIR] [--repeats 3] [--avx2]

Each run is one process (OMP_NUM_THREADS=1, as torchrun gives each rank) training configs/parcae-tiny.yaml; the time is
taken when its first "train" record reaches metrics.jsonl (so it includes step 0 itself, the same in every row), and
the process is then stopped. "cold" starts with an empty cache directory, "warm" reuses the one a cold run filled.
The peak's own cost is read from the run header ("measured now in X s"; nothing for a cached peak). --avx2 caps
oneDNN at AVX2 (ONEDNN_MAX_CPU_ISA), so a CPU with native bf16 behaves like an AVX2-only one.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def time_to_first_step(checkout: Path, shards: Path, cache: Path, env_extra: dict) -> tuple[float, str]:
    """(seconds from start to the first train record, the run header or '')."""
    out = Path(tempfile.mkdtemp(prefix="startup-"))
    cmd = [sys.executable, "-m", "megaloop", "train", str(checkout / "configs" / "parcae-tiny.yaml"),
           "--set", f"data.shards={shards}", "--set", f"train.out_dir={out}", "--set", "train.steps=50",
           "--set", "train.progress=false", "--set", "train.val_every=1000"]
    env = dict(os.environ, OMP_NUM_THREADS="1", MEGALOOP_CACHE_DIR=str(cache), PYTHONPATH=str(checkout), **env_extra)
    log = out.parent / f"{out.name}.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=f, stderr=subprocess.STDOUT)
    metrics = out / "metrics.jsonl"
    try:
        while proc.poll() is None:
            if metrics.exists() and '"kind": "train"' in metrics.read_text():
                return time.perf_counter() - t0, _header(log)
            time.sleep(0.02)
        raise RuntimeError(f"the run ended (rc {proc.returncode}) before its first step:\n{log.read_text()[-2000:]}")
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(out, ignore_errors=True)
        log.unlink(missing_ok=True)


def _header(log: Path) -> str:
    return next((line for line in log.read_text().splitlines() if line.startswith("megaloop: train ")), "")


def peak_seconds(header: str) -> float:
    found = re.search(r"measured now in ([\d.]+) s", header)
    return float(found.group(1)) if found else 0.0


def measure(label: str, checkout: Path, shards: Path, repeats: int, env_extra: dict) -> dict:
    rows = {"cold": [], "warm": []}
    peaks = {"cold": [], "warm": []}
    for _ in range(repeats):
        cache = Path(tempfile.mkdtemp(prefix="startup-cache-"))
        for state in ("cold", "warm"):
            seconds, header = time_to_first_step(checkout, shards, cache, env_extra)
            rows[state].append(seconds)
            peaks[state].append(peak_seconds(header))
        shutil.rmtree(cache, ignore_errors=True)
    for state in ("cold", "warm"):
        print(f"{label:<10} {state:<5} first step after {statistics.median(rows[state]):6.2f} s (median of {repeats}: "
              f"{', '.join(f'{x:.2f}' for x in rows[state])}); peak measured in the run: "
              f"{statistics.median(peaks[state]):.2f} s", flush=True)
    return {state: statistics.median(v) for state, v in rows.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", required=True, type=Path, help="shards of 129-token rows, vocab <= 4096 (the "
                    "quickstart's)")
    ap.add_argument("--before", type=Path, default=None, help="another checkout to time the same way")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--avx2", action="store_true", help="cap oneDNN at AVX2 (no native bf16)")
    args = ap.parse_args()
    env_extra = {"ONEDNN_MAX_CPU_ISA": "AVX2"} if args.avx2 else {}
    print(f"parcae-tiny (default precision), 1 thread{', oneDNN capped at AVX2' if args.avx2 else ''}", flush=True)
    now = measure("this", REPO, args.shards.resolve(), args.repeats, env_extra)
    print(f"this: the peak adds {now['cold'] - now['warm']:+.2f} s with a cold cache (warm: read from the cache)")
    if args.before:
        before = measure("before", args.before.resolve(), args.shards.resolve(), args.repeats, env_extra)
        print(f"before: {before['cold']:.2f} s to the first step; this checkout, warm: {now['warm']:.2f} s "
              f"({before['cold'] - now['warm']:+.2f} s), cold: {now['cold']:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
