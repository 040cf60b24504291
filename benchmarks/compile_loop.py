"""train.compile on the CPU: 20 forward+backward steps with per-sequence depths (poisson-truncated-full, a fresh draw
each step), compiled blocks vs eager side by side in one run (same weights, depths and tokens). Prints the graphs
compiled at each step (recompilations after the first step, target <= 2), the first compiled step's time, the median
step time of the later steps compiled vs eager (this process's CPU time on one thread, and the median: robust to
other load on a shared machine), and the largest difference of loss and gradients (fp32).

    python benchmarks/compile_loop.py [--config parcae-tiny] [--steps 20] [--batch 8] [--seq 128] [--mu-rec 8]
        [--threads 1]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _batches(cfg, steps: int, batch: int, seq: int, mu_rec: int):
    import numpy as np
    import torch

    from megaloop.depth import make_sampler

    sampler = make_sampler("poisson-truncated-full", mu_rec, mu_rec // 2, seed=0)
    g = torch.Generator().manual_seed(0)
    for step in range(steps):
        depth = sampler.sample(step, np.arange(step * batch, (step + 1) * batch))
        yield torch.randint(0, cfg.model.vocab_size, (batch, seq), generator=g), depth.T.numpy(), depth.k.numpy()


def _step(model, ids, depth, k):
    t0 = time.process_time()
    out = model(ids, labels=ids, depth=depth, backprop_depth=k)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return time.process_time() - t0, out.loss.detach(), grads


def run(config: str, steps: int, batch: int, seq: int, mu_rec: int) -> None:
    from torch._dynamo.utils import counters

    from megaloop.config import load_config
    from megaloop.model import build_model

    cfg = load_config(REPO / "configs" / f"{config}.yaml", [f"model.seq_len={seq}", f"model.mu_rec={mu_rec}",
                                                             f"model.mu_bwd={mu_rec // 2}"])
    eager = build_model(cfg.model)
    compiled = copy.deepcopy(eager)
    compiled.set_compile(True)
    times = {"eager": [], "compiled": []}
    graphs, worst = [], 0.0
    for i, (ids, depth, k) in enumerate(_batches(cfg, steps, batch, seq, mu_rec)):
        before = counters["stats"]["unique_graphs"]
        tc, loss_c, grads_c = _step(compiled, ids, depth, k)
        graphs.append(counters["stats"]["unique_graphs"] - before)
        te, loss_e, grads_e = _step(eager, ids, depth, k)
        times["compiled"].append(tc)
        times["eager"].append(te)
        err = max(((grads_c[n] - g).abs().max() / max(g.abs().max().item(), 1.0)).item() for n, g in grads_e.items())
        worst = max(worst, err, abs((loss_c - loss_e).item()))
        print(f"step {i:2d} depths {depth.tolist()}: graphs compiled {graphs[-1]}, compiled {tc:.2f}s eager "
              f"{te:.2f}s", flush=True)
    later_c = statistics.median(times["compiled"][1:])
    later_e = statistics.median(times["eager"][1:])
    print(f"{config} batch {batch} seq {seq} mu_rec {mu_rec}: graphs at step 0 {graphs[0]}, recompilations over "
          f"steps 1-{steps - 1}: {sum(graphs[1:])}; first compiled step {times['compiled'][0]:.1f} CPU-s; later steps "
          f"compiled {later_c:.3f}s eager {later_e:.3f}s (compiled/eager {later_c / later_e:.2f}x); max |diff| loss "
          f"and relative grads {worst:.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="parcae-tiny")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--mu-rec", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    import torch

    torch.set_num_threads(a.threads)
    run(a.config, a.steps, a.batch, a.seq, a.mu_rec)


if __name__ == "__main__":
    main()
