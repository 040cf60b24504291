"""Executed core passes per useful one, plain vs depth-bucketed micro-batching, averaged over many steps.

A micro-batch runs max(T) core passes for each of its sequences; the ratio executed / sum_i T_i is 1.0 when no pass
is wasted on a sequence that has already reached its depth. Usage (from the repository root):

    python benchmarks/depth_bucketing.py --mu-rec 8 --micro-batch 32 --global-batch 256 --steps 1000
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaloop.depth import (  # noqa: E402  (after the path set-up)
    SAMPLERS,
    bucketed_cost,
    contiguous_cost,
    contiguous_microbatches,
    make_sampler,
    plan_rank_microbatches,
    rank_executed_passes,
)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sampler", default="poisson-truncated-full", choices=sorted(SAMPLERS))
    parser.add_argument("--mu-rec", type=int, default=8)
    parser.add_argument("--mu-bwd", type=int, default=None, help="default ceil(mu_rec / 2)")
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--dp", type=int, default=1, help="data-parallel ranks sharing the bucketed micro-batches")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def _contiguous_rank_plan(batch: int, micro_batch: int, dp: int) -> list[list[np.ndarray]]:
    """Plain data parallelism: rank r takes the r-th contiguous share of the contiguous micro-batches."""
    microbatches = contiguous_microbatches(batch, micro_batch)
    per_rank = len(microbatches) // dp
    return [microbatches[r * per_rank:(r + 1) * per_rank] for r in range(dp)]


def _dp_step_ratio(depths, plan) -> float:
    """dp * (executed passes of the busiest rank) / (sum of depths): the waste when ranks wait for the slowest."""
    loads = rank_executed_passes(depths, plan)
    return len(loads) * max(loads) / float(depths.sum())


def run(args: argparse.Namespace) -> dict[str, float]:
    """Averages over the steps; returns the figures it prints."""
    sampler = make_sampler(args.sampler, args.mu_rec, args.mu_bwd, args.seed)
    plain, bucketed, depth_means, dp_plain, dp_bucketed = [], [], [], [], []
    plain_exec = bucketed_exec = useful = 0
    start = time.perf_counter()
    for step in range(args.steps):
        depths = sampler.sample(step, step * args.global_batch + np.arange(args.global_batch)).T
        plain_cost = contiguous_cost(depths, args.micro_batch)
        bucket_cost = bucketed_cost(depths, args.micro_batch)
        plain.append(plain_cost.ratio)
        bucketed.append(bucket_cost.ratio)
        depth_means.append(float(depths.double().mean()))
        plain_exec, bucketed_exec = plain_exec + plain_cost.executed, bucketed_exec + bucket_cost.executed
        useful += plain_cost.useful
        if args.dp > 1:
            dp_plain.append(_dp_step_ratio(depths, _contiguous_rank_plan(depths.numel(), args.micro_batch, args.dp)))
            dp_bucketed.append(_dp_step_ratio(depths, plan_rank_microbatches(depths, args.micro_batch, args.dp)))
    elapsed = time.perf_counter() - start
    per_mb = args.micro_batch * args.steps * (args.global_batch // args.micro_batch)
    figures = {
        "mean_depth": float(np.mean(depth_means)),
        "plain_ratio": float(np.mean(plain)), "plain_ratio_std": float(np.std(plain)),
        "bucketed_ratio": float(np.mean(bucketed)), "bucketed_ratio_std": float(np.std(bucketed)),
        "plain_passes_per_seq": plain_exec / per_mb, "bucketed_passes_per_seq": bucketed_exec / per_mb,
        "pooled_plain_ratio": plain_exec / useful, "pooled_bucketed_ratio": bucketed_exec / useful,
    }
    print(f"sampler {sampler.name}, mu_rec {sampler.mu_rec}, mu_bwd {sampler.mu_bwd}, micro-batch {args.micro_batch}, "
          f"global batch {args.global_batch}, {args.steps} steps, seed {args.seed} ({elapsed:.2f} s)")
    print(f"mean sampled depth                      {figures['mean_depth']:.4f} (formula {sampler.mean():.4f})")
    print(f"executed core passes per sequence        plain {figures['plain_passes_per_seq']:.3f}, "
          f"bucketed {figures['bucketed_passes_per_seq']:.3f}")
    print(f"executed / sum of depths (mean of steps) plain {figures['plain_ratio']:.4f} "
          f"(sd {figures['plain_ratio_std']:.4f}), bucketed {figures['bucketed_ratio']:.4f} "
          f"(sd {figures['bucketed_ratio_std']:.4f})")
    print(f"executed / sum of depths (pooled)        plain {figures['pooled_plain_ratio']:.4f}, "
          f"bucketed {figures['pooled_bucketed_ratio']:.4f}")
    if dp_plain:
        figures["dp_plain_ratio"], figures["dp_bucketed_ratio"] = float(np.mean(dp_plain)), float(np.mean(dp_bucketed))
        print(f"dp={args.dp}, step time set by the busiest rank: dp * max_rank(executed) / sum of depths: "
              f"plain {figures['dp_plain_ratio']:.4f}, bucketed {figures['dp_bucketed_ratio']:.4f}")
    return figures


if __name__ == "__main__":
    run(parse_args())
