"""Time from `python -m megaloop train` to its first optimizer step, with a cold and a warm CPU-peak cache, beside
another checkout (e.g. one from before the peak was cached) run the same way, side by side in one run.

    python benchmarks/startup.py --shards SHARD_DIR [--before CHECKOUT_DIR] [--repeats 3] [--avx2]
    python benchmarks/startup.py --build configs/parcae-1_3b.yaml [--dp 1,8,16] [--full-fresh]

Each run is one process (OMP_NUM_THREADS=1, as torchrun gives each rank) training configs/parcae-tiny.yaml; the time is
taken when its first "train" record reaches metrics.jsonl (so it includes step 0 itself, the same in every row), and
the process is then stopped. "cold" starts with an empty cache directory, "warm" reuses the one a cold run filled.
The peak's own cost is read from the run header ("measured now in X s"; nothing for a cached peak). --avx2 caps
oneDNN at AVX2 (ONEDNN_MAX_CPU_ISA), so a CPU with native bf16 behaves like an AVX2-only one.

--build times the trainer's model build alone (megaloop.train.loop.build_model_and_optimizer, one thread, CPU, fp32)
for a resumed job (parameters allocated, not initialised: the checkpoint fills them) and a fresh one, and counts the
calls of the per-parameter init (megaloop.model.init_parameter, as megaloop.train.build calls it). The fresh build
is timed in full with --full-fresh (parcae-1_3b: minutes); otherwise the init of the non-block parameters and of one
block of each kind is timed and the rest extrapolated per block (said so in the output). --dp prints each data-
parallel size's share of the init (the largest rank's, as megaloop.train.build deals it by cost).
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


def _counted_init():
    """Wrap megaloop.train.build's init_parameter with a counter; returns the list of names it is called with."""
    from megaloop.train import build

    calls, real = [], build.init_parameter

    def counting(cfg, name, *args, **kwargs):
        calls.append(name)
        return real(cfg, name, *args, **kwargs)

    build.init_parameter = counting
    return calls


def _block_of(name: str) -> str | None:
    """'prelude.3' for prelude.3.attn.q.weight: the block a parameter belongs to (None outside the blocks)."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] in ("prelude", "core", "coda") else None


def _fresh_estimate(cfg) -> tuple[float, str]:
    """Seconds of the full init, from the non-block parameters and the first block of each stack timed (every block
    of a stack has the same shapes), and how it was obtained."""
    from megaloop.model import build_model, init_parameter

    model = build_model(cfg.model, device="meta")
    blocks: dict[str, int] = {}
    timed: dict[str, float] = {}
    for name, p in model.named_parameters():
        block = _block_of(name)
        stack = block.split(".")[0] if block else name
        blocks.setdefault(stack, 0)
        if block is None or block.endswith(".0"):
            t0 = time.perf_counter()
            init_parameter(cfg.model, name, p.shape, cfg.train.seed)
            timed[stack] = timed.get(stack, 0.0) + time.perf_counter() - t0
    counts = {s: len({_block_of(n) for n, _ in model.named_parameters() if n.startswith(s + ".")}) or 1
              for s in timed}
    total = sum(timed[s] * (counts[s] if s in ("prelude", "core", "coda") else 1) for s in timed)
    return total, "non-block parameters and block 0 of each stack timed, other blocks extrapolated"


def build_times(config: str, dps: list[int], full_fresh: bool) -> None:
    sys.path.insert(0, str(REPO))
    import torch

    from megaloop.config import load_config
    from megaloop.model import build_model
    from megaloop.model.init import init_parameter_cost
    from megaloop.train.loop import build_model_and_optimizer
    from megaloop.train.runtime import SingleProcessRuntime
    from pipeline.dist_muon import assign_owners

    torch.set_num_threads(1)
    cfg = load_config(config, ["train.precision=fp32"])
    cpu = torch.device("cpu")
    calls = _counted_init()
    t0 = time.perf_counter()
    model, optimizer = build_model_and_optimizer(cfg, SingleProcessRuntime(cpu), cpu, False, init=False)
    first = time.perf_counter() - t0  # includes torch's lazy imports (the meta device's first use)
    del model, optimizer
    t0 = time.perf_counter()
    model, optimizer = build_model_and_optimizer(cfg, SingleProcessRuntime(cpu), cpu, False, init=False)
    resumed = time.perf_counter() - t0
    n = sum(1 for _ in model.parameters())
    print(f"{Path(config).stem}, 1 thread, fp32: {sum(p.numel() for p in model.parameters()) / 1e9:.3f} B "
          f"parameters in {n} tensors", flush=True)
    print(f"resumed build (allocated, not initialised): {resumed:.2f} s ({first:.2f} s the first time in the process, "
          f"torch's lazy imports included), init_parameter called {len(calls)} times in both", flush=True)
    del model, optimizer
    calls.clear()
    if full_fresh:
        t0 = time.perf_counter()
        model, optimizer = build_model_and_optimizer(cfg, SingleProcessRuntime(cpu), cpu, False, init=True)
        fresh, how = time.perf_counter() - t0, "the whole build timed"
        del model, optimizer
        print(f"fresh build (initialised): {fresh:.1f} s ({how}), init_parameter called {len(calls)} times")
    else:
        fresh, how = _fresh_estimate(cfg)
        print(f"fresh build (initialised): ~{fresh:.1f} s of init ({how}); init_parameter is called {n} times "
              f"(once per tensor)")
    print(f"resumed / fresh: {resumed / fresh:.4f}")
    meta = build_model(cfg.model, device="meta")
    costs = [init_parameter_cost(name, p.shape) for name, p in meta.named_parameters()]
    for dp in dps:
        owners = assign_owners(costs, dp)
        share = max(sum(c for c, o in zip(costs, owners) if o == r) for r in range(dp)) / sum(costs)
        print(f"  fresh at dp {dp:>3}: the busiest rank inits {share:.3f} of the cost (ideal {1 / dp:.3f}): "
              f"~{fresh * share:.1f} s, then one broadcast of the parameters over the dp group")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=None, help="time the model build of this config, resumed and fresh")
    ap.add_argument("--dp", default="1,8,16", help="--build: data-parallel sizes to show the init share of")
    ap.add_argument("--full-fresh", action="store_true", help="--build: time the whole fresh build (minutes)")
    ap.add_argument("--shards", type=Path, help="shards of 129-token rows, vocab <= 4096 (the "
                    "quickstart's)")
    ap.add_argument("--before", type=Path, default=None, help="another checkout to time the same way")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--avx2", action="store_true", help="cap oneDNN at AVX2 (no native bf16)")
    args = ap.parse_args()
    if args.build:
        build_times(args.build, [int(x) for x in args.dp.split(",")], args.full_fresh)
        return 0
    if args.shards is None:
        ap.error("--shards is required (or --build CONFIG)")
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
