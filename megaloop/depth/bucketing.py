"""Depth-bucketed micro-batching: group sequences of similar sampled depth so that fewer idle loop passes run.

A micro-batch runs as many core passes as its deepest sequence, for every sequence in it (shallower ones hold their
state). Its cost in core passes is therefore max(T) * size, and the waste of a micro-batching is measured by
executed / useful = sum_mb max_depth(mb) * |mb| / sum_i T_i (1.0 means no idle pass).

Data parallelism: bucketing is a pure function of the depths of the WHOLE global batch, computed before the batch is
split across data-parallel ranks; every rank computes the same buckets and `assign_buckets_to_ranks` deterministically
deals them out, so no rank needs to communicate to agree on the plan.

Optimality of sorting (equal-size micro-batches). Let the B = m b depths be sorted d_1 >= d_2 >= ... >= d_B and take
any partition into m groups of size b, numbered so that their maxima are M_1 >= ... >= M_m. Groups 1..j-1 hold only
(j-1) b sequences, so one of the (j-1) b + 1 deepest sequences lies in a group j' >= j, whence
M_j >= M_j' >= d_{(j-1) b + 1}. Summing over j, sum_j M_j >= sum_j d_{(j-1) b + 1}, which is exactly the cost of
cutting the sorted order into consecutive chunks of b (chunk j's maximum is d_{(j-1) b + 1}). With equal sizes the
executed passes are b * sum_j M_j, so sorted chunks minimise them too. (tests/depth checks it by brute force.)
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np
import torch


def _depth_array(depths) -> np.ndarray:
    """Depths as a 1-D int64 numpy array (from a list, numpy array or torch tensor)."""
    if isinstance(depths, torch.Tensor):
        depths = depths.detach().cpu().numpy()
    arr = np.asarray(depths)
    if arr.ndim != 1:
        raise ValueError(f"depths must be 1-D (one per sequence of the global batch), got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"depths must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64)


def _check_divisible(batch_size: int, micro_batch_size) -> int:
    micro_batch_size = operator.index(micro_batch_size)
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    if batch_size % micro_batch_size:
        raise ValueError(f"global batch of {batch_size} sequences is not a multiple of micro_batch_size "
                         f"{micro_batch_size}; choose sizes with global_batch = micro_batch_size * count")
    return micro_batch_size


def contiguous_microbatches(batch_size: int, micro_batch_size: int) -> list[np.ndarray]:
    """The plain micro-batching: consecutive positions 0..b-1, b..2b-1, ... of the global batch."""
    micro_batch_size = _check_divisible(operator.index(batch_size), micro_batch_size)
    return [np.arange(start, start + micro_batch_size, dtype=np.int64)
            for start in range(0, batch_size, micro_batch_size)]


def bucket_microbatches(depths, micro_batch_size: int) -> list[np.ndarray]:
    """Positions of the global batch grouped into micro-batches of similar depth (minimal executed passes).

    Sorts the positions by depth (stable, so ties keep position order: deterministic) and cuts consecutive chunks
    of `micro_batch_size`. Returns the chunks in order of increasing depth, each chunk's positions in increasing
    order. The chunks together are a permutation of range(len(depths)): the same sequences, with the same depths.
    """
    depth_arr = _depth_array(depths)
    micro_batch_size = _check_divisible(depth_arr.size, micro_batch_size)
    order = np.argsort(depth_arr, kind="stable")
    return [np.sort(order[start:start + micro_batch_size])
            for start in range(0, depth_arr.size, micro_batch_size)]


def executed_core_passes(depths, microbatches) -> int:
    """Core passes that actually run: sum over micro-batches of (deepest depth in it) * (its size)."""
    depth_arr = _depth_array(depths)
    return int(sum(int(depth_arr[mb].max()) * len(mb) for mb in microbatches if len(mb)))


@dataclass(frozen=True)
class MicrobatchingCost:
    """Executed core passes of a micro-batching, the useful ones (sum of depths) and their ratio (>= 1)."""

    executed: int
    useful: int

    @property
    def ratio(self) -> float:
        return self.executed / self.useful if self.useful else 1.0


def microbatching_cost(depths, microbatches) -> MicrobatchingCost:
    """Executed and useful core passes of this micro-batching of a global batch with these depths."""
    depth_arr = _depth_array(depths)
    return MicrobatchingCost(executed_core_passes(depth_arr, microbatches), int(depth_arr.sum()))


def executed_to_useful_ratio(depths, microbatches) -> float:
    """(sum_mb max_depth * mb_size) / sum_i T_i: executed core passes per useful one (1.0 = no idle pass)."""
    return microbatching_cost(depths, microbatches).ratio


def contiguous_cost(depths, micro_batch_size: int) -> MicrobatchingCost:
    """Cost of the plain (contiguous) micro-batching of these depths."""
    depth_arr = _depth_array(depths)
    return microbatching_cost(depth_arr, contiguous_microbatches(depth_arr.size, micro_batch_size))


def bucketed_cost(depths, micro_batch_size: int) -> MicrobatchingCost:
    """Cost of the depth-bucketed micro-batching of these depths."""
    depth_arr = _depth_array(depths)
    return microbatching_cost(depth_arr, bucket_microbatches(depth_arr, micro_batch_size))


def assign_buckets_to_ranks(buckets, dp: int, depths) -> list[list[np.ndarray]]:
    """Deal the micro-batches of a global batch to `dp` data-parallel ranks with balanced executed work.

    Every rank gets the same number of micro-batches (len(buckets) must be a multiple of dp). Greedy longest-first:
    buckets in decreasing cost (max depth * size; ties by bucket number) each go to the least-loaded rank that has
    room (ties to the lowest rank). A pure function of (buckets, dp, depths): every rank computes the same plan.
    Returns, per rank, its micro-batches in increasing bucket number.
    """
    dp = operator.index(dp)
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    if len(buckets) % dp:
        raise ValueError(f"{len(buckets)} micro-batches cannot be shared equally by dp={dp} ranks; "
                         f"make global_batch / micro_batch_size a multiple of dp")
    depth_arr = _depth_array(depths)
    per_rank = len(buckets) // dp
    costs = [int(depth_arr[b].max()) * len(b) if len(b) else 0 for b in buckets]
    by_cost = sorted(range(len(buckets)), key=lambda j: (-costs[j], j))
    loads, owned = [0] * dp, [[] for _ in range(dp)]
    for j in by_cost:
        rank = min((r for r in range(dp) if len(owned[r]) < per_rank), key=lambda r: (loads[r], r))
        owned[rank].append(j)
        loads[rank] += costs[j]
    return [[buckets[j] for j in sorted(mine)] for mine in owned]


def plan_rank_microbatches(depths, micro_batch_size: int, dp: int) -> list[list[np.ndarray]]:
    """Bucket a global batch's depths, then deal the micro-batches to dp ranks (positions in the global batch)."""
    return assign_buckets_to_ranks(bucket_microbatches(depths, micro_batch_size), dp, depths)


def rank_executed_passes(depths, rank_microbatches) -> list[int]:
    """Executed core passes of each rank under a plan from `assign_buckets_to_ranks`."""
    return [executed_core_passes(depths, mbs) for mbs in rank_microbatches]
