"""Cost of the per-parameter initialisation (float64 on one thread, keyed by (seed, name)) against the previous
recipe (one float32 QR on all of torch's threads), side by side in one process.

    python benchmarks/init_cost.py [--size 2048] [--config configs/parcae-1_3b.yaml] [--repeats 3] [--no-full]
                                   [--with-previous] [--dp 8,16]

Prints: one size x size orthogonal matrix (new, previous); the full init of --config, every parameter computed and
dropped at once (so the figure is compute, not memory), with the share of the largest parameter kinds and, with
--with-previous, the previous recipe's time for the same shapes. A pipeline stage or tensor-parallel rank pays only
for the parameters it holds. --dp: a fresh job deals the init over its data-parallel ranks by
megaloop.model.init.init_parameter_cost (megaloop/train/build.py); the busiest rank's measured seconds under that
dealing, against the ideal 1/dp.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megaloop.config import load_config  # noqa: E402
from megaloop.model import build_model, init_parameter  # noqa: E402


def previous_orthogonal(shape, std: float, g: torch.Generator) -> torch.Tensor:
    """The previous recipe for one orthogonal matrix: a float32 truncated normal (+-2) on torch's threads, QR,
    signs fixed by R's diagonal, gain std * sqrt(max(rows, cols))."""
    rows, cols = shape[0], math.prod(shape) // shape[0]
    flat = torch.nn.init.trunc_normal_(torch.empty(max(rows, cols), min(rows, cols)), 0.0, 1.0, -2.0, 2.0,
                                       generator=g)
    q, r = torch.linalg.qr(flat)
    q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
    return (q.t() if rows < cols else q).reshape(shape) * (std * math.sqrt(max(rows, cols)))


def _best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def one_matrix(size: int, repeats: int) -> None:
    cfg = dataclasses.replace(load_config(None).model, d_model=size)
    shape = (size, size)
    new = _best_of(lambda: init_parameter(cfg, "core.0.attn.q.weight", shape, seed=0), repeats)
    g = torch.Generator().manual_seed(0)
    old = _best_of(lambda: previous_orthogonal(shape, cfg.std, g), repeats)
    print(f"one {size}x{size} orthogonal: per-parameter fp64 1 thread {new:.3f} s, "
          f"previous fp32 {torch.get_num_threads()} threads {old:.3f} s, ratio {new / old:.2f}")


ORTHOGONAL = ("embed.weight", "C.weight", ".attn.q.weight", ".attn.k.weight", ".attn.v.weight", ".mlp.fc.weight")


def _kind(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[2:]) if parts[0] in ("prelude", "core", "coda") else parts[0]


def _previous(name: str, shape, std: float, g: torch.Generator) -> None:
    """The previous recipe's work for one parameter: fp32 on all threads, one shared generator."""
    if name.endswith(ORTHOGONAL):
        previous_orthogonal(shape, std, g)
    elif name.startswith("value_embeds."):
        torch.empty(shape).normal_(0.0, 1.0, generator=g)


def dealt(names_shapes_times: list, dps: list[int]) -> None:
    """The busiest rank's measured init seconds when the parameters are dealt by cost over dp ranks."""
    from megaloop.model.init import init_parameter_cost
    from pipeline.dist_muon import assign_owners

    costs = [init_parameter_cost(name, shape) for name, shape, _ in names_shapes_times]
    total = sum(t for _, _, t in names_shapes_times)
    for dp in dps:
        owners = assign_owners(costs, dp)
        busiest = max(sum(t for (_, _, t), o in zip(names_shapes_times, owners) if o == r) for r in range(dp))
        print(f"  dealt over dp {dp}: busiest rank {busiest:.1f} s ({busiest / total:.3f} of the init; ideal "
              f"{1 / dp:.3f})")


def full_init(config: str, with_previous: bool, dps: list[int] = ()) -> None:
    cfg = load_config(config).model
    model = build_model(cfg, device="meta")
    per_kind: dict[str, float] = defaultdict(float)
    timed = []
    t0 = time.perf_counter()
    for name, p in model.named_parameters():
        t = time.perf_counter()
        init_parameter(cfg, name, p.shape, seed=0)
        per_kind[_kind(name)] += time.perf_counter() - t
        timed.append((name, tuple(p.shape), time.perf_counter() - t))
    elapsed = time.perf_counter() - t0
    total = sum(p.numel() for p in model.parameters())
    print(f"full init of {Path(config).stem} ({total / 1e9:.3f} B parameters, "
          f"{sum(1 for _ in model.parameters())} tensors): per-parameter fp64 1 thread {elapsed:.1f} s")
    for kind, secs in sorted(per_kind.items(), key=lambda kv: -kv[1])[:6]:
        print(f"  {kind:<22} {secs:7.1f} s  ({100 * secs / elapsed:4.1f} %)")
    per_block = sum(v for k, v in per_kind.items() if k.startswith(("attn.", "mlp.", "norm_"))) / cfg.n_layers
    stage_blocks = math.ceil(cfg.n_core / 4)
    print(f"  one block {per_block:.2f} s; e.g. a stage holding {stage_blocks} core blocks (the core over 4 stages) "
          f"pays ~{per_block * stage_blocks:.1f} s")
    dealt(timed, dps)
    if with_previous:
        g = torch.Generator().manual_seed(0)
        t0 = time.perf_counter()
        for name, p in model.named_parameters():
            _previous(name, p.shape, cfg.std, g)
        old = time.perf_counter() - t0
        print(f"  previous recipe (fp32, {torch.get_num_threads()} threads): {old:.1f} s, ratio {elapsed / old:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=2048)
    ap.add_argument("--config", default=str(REPO / "configs" / "parcae-1_3b.yaml"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-full", action="store_true", help="skip the full-model init")
    ap.add_argument("--with-previous", action="store_true", help="also time the previous recipe on the full model")
    ap.add_argument("--dp", default="8,16", help="data-parallel sizes to deal the full init over (empty: none)")
    args = ap.parse_args()
    one_matrix(args.size, args.repeats)
    if not args.no_full:
        full_init(args.config, args.with_previous, [int(x) for x in args.dp.split(",") if x])


if __name__ == "__main__":
    main()
