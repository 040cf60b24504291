"""Peak memory of a parcae-140m training step (forward+backward, fp32, CPU) with activation checkpointing none,
block and lap. Each setting runs in its own process with the measurement of benchmarks/loop_memory.py: blocks
above 64 KiB mmapped, the kernel's peak mark reset just before the step, figure = peak RSS - RSS before the step.

    python benchmarks/activation_memory.py [--config parcae-140m] [--batch 4] [--seq 256] [--depth 8] [--k 4]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.loop_memory import MEASURE_ENV, _reset_peak, _rss_peak_mb, _status_mb  # noqa: E402

MODES = ("none", "block", "lap")


def one_step(mode: str, config: str, batch: int, seq: int, depth: int, k: int) -> dict:
    import torch

    from megaloop.config import load_config
    from megaloop.model import build_model

    cfg = load_config(REPO / "configs" / f"{config}.yaml", [f"model.seq_len={seq}"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    model.set_activation_checkpointing(mode)
    ids = torch.randint(0, cfg.model.vocab_size, (batch, seq))
    model(ids[:1, :8], labels=ids[:1, :8], depth=2, backprop_depth=1).loss.backward()  # warm up kernels
    before = _status_mb("VmRSS") if _reset_peak() else _rss_peak_mb()
    model(ids, labels=ids, depth=depth, backprop_depth=k).loss.backward()
    return {"mode": mode, "step_peak_mb": _rss_peak_mb() - before}


def measure(config="parcae-140m", batch=4, seq=256, depth=8, k=4) -> list[dict]:
    rows = []
    for mode in MODES:
        code = (f"import json,sys; sys.path.insert(0, {str(REPO)!r}); "
                "from benchmarks.activation_memory import one_step; "
                f"print(json.dumps(one_step({mode!r}, {config!r}, {batch}, {seq}, {depth}, {k})))")
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=REPO,
                             env=MEASURE_ENV)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="parcae-140m")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--k", type=int, default=4, help="laps with gradient (truncated backprop)")
    a = ap.parse_args()
    rows = measure(a.config, a.batch, a.seq, a.depth, a.k)
    base = rows[0]["step_peak_mb"]
    for r in rows:
        print(f"{a.config} batch {a.batch} seq {a.seq} T={a.depth} k={a.k} activation_checkpointing={r['mode']:<5}: "
              f"step peak {r['step_peak_mb']:8.1f} MB ({r['step_peak_mb'] / base:.2f}x none)", flush=True)


if __name__ == "__main__":
    main()
