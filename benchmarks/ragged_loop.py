"""Ragged vs masked loop on the CPU: tokens/s of forward+backward of one micro-batch with per-sequence depths
(poisson-truncated-full at mu_rec 8, truncated backprop k_i = min(T_i, mu_bwd)), both loops timed side by side in
one run (alternating, same depths and weights; each micro-batch timed `repeats` times per loop, the fastest kept);
prints the masked loop's executed/useful core passes beside the speed ratio. Time is this process's CPU time on one
thread (tokens per CPU-second): on a shared machine, wall time mostly measures the other processes' load.

    python benchmarks/ragged_loop.py [--configs parcae-tiny parcae-140m] [--steps 4] [--batch 8 8] [--seq 128 64]
        [--repeats 2] [--threads 1]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def build(config: str, mu_rec: int, seq: int):
    import torch

    from megaloop.config import load_config
    from megaloop.model import build_model

    cfg = load_config(REPO / "configs" / f"{config}.yaml", [f"model.mu_rec={mu_rec}", f"model.mu_bwd={mu_rec // 2}",
                                                             f"model.seq_len={seq}"])
    torch.manual_seed(0)
    return cfg, build_model(cfg.model)


def fwd_bwd(model, ids, depths, k) -> tuple[float, dict]:
    t0 = time.process_time()
    out = model(ids, labels=ids, depth=depths, backprop_depth=k)
    out.loss.backward()
    model.zero_grad(set_to_none=True)
    return time.process_time() - t0, out.telemetry


def bench(config: str, batch: int, seq: int, steps: int, repeats: int = 2, mu_rec: int = 8) -> dict:
    import numpy as np
    import torch

    from megaloop.depth import make_sampler

    cfg, model = build(config, mu_rec, seq)
    sampler = make_sampler("poisson-truncated-full", mu_rec, mu_rec // 2, seed=0)
    g = torch.Generator().manual_seed(0)
    times = {True: 0.0, False: 0.0}
    rows = {True: 0, False: 0}
    useful = 0
    fwd_bwd(model, torch.randint(0, cfg.model.vocab_size, (1, seq), generator=g), 2, 1)  # warm-up
    for step in range(steps):
        depth = sampler.sample(step, np.arange(step * batch, (step + 1) * batch))
        ids = torch.randint(0, cfg.model.vocab_size, (batch, seq), generator=g)
        for ragged in ((True, False) if step % 2 == 0 else (False, True)):  # alternate who goes first
            model.ragged_loop = ragged
            runs = [fwd_bwd(model, ids, depth.T.numpy(), depth.k.numpy()) for _ in range(repeats)]
            times[ragged] += min(dt for dt, _ in runs)
            tel = runs[0][1]
            rows[ragged] += tel["core_rows"]
        useful += int(depth.T.sum())
    tokens = steps * batch * seq
    return {"config": config, "batch": batch, "seq": seq, "useful": useful, "ragged_rows": rows[True],
            "masked_rows": rows[False], "ragged_tps": tokens / times[True], "masked_tps": tokens / times[False]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["parcae-tiny", "parcae-140m"])
    ap.add_argument("--batch", nargs="+", type=int, default=[8, 8], help="micro-batch per config")
    ap.add_argument("--seq", nargs="+", type=int, default=[128, 64], help="sequence length per config")
    ap.add_argument("--steps", type=int, default=4, help="micro-batches per loop (each with fresh depths)")
    ap.add_argument("--repeats", type=int, default=2, help="timings per micro-batch and loop (the fastest is kept)")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    for i, config in enumerate(a.configs):
        r = bench(config, a.batch[min(i, len(a.batch) - 1)], a.seq[min(i, len(a.seq) - 1)], a.steps, a.repeats)
        print(f"{r['config']:<12} batch {r['batch']} seq {r['seq']} mu_rec 8: core passes useful {r['useful']}, "
              f"ragged {r['ragged_rows']} ({r['ragged_rows'] / r['useful']:.2f}x), masked {r['masked_rows']} "
              f"(executed/useful {r['masked_rows'] / r['useful']:.2f}x) | tokens/CPU-s ragged {r['ragged_tps']:,.0f} "
              f"masked {r['masked_tps']:,.0f} speed-up {r['ragged_tps'] / r['masked_tps']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
