"""Cost-balanced data parallelism: deal a global batch's sequences to data-parallel ranks by their work.

Under the ragged loop a micro-batch runs exactly sum(T_i) core passes, whatever its grouping, so a rank's loop work is
the sum of the depths of the rows it holds. A row also costs its prelude, coda and head (forward and backward, the
same for every row) and its laps are not alike (a lap with gradient costs about three without), so the trainer deals
by each row's whole cost, `row_costs`: non_loop + n x c_ng + k x c_g FLOPs per token (megaloop.train.flops's
coefficients; n laps without gradient, k with). Dealing by depth alone is `costs=None`. The depths (so the costs) of
a global batch are pure functions of (seed, step, global sample index), known before any token is read, so every
rank can compute the same dealing on its own and its loader then reads only its rows.

`deal_by_depth` is longest-processing-time-first greedy: sequences in decreasing cost (ties by position) each go to
the rank with the least work so far (ties: fewer rows, then the lower rank), so ranks may hold different numbers of
rows; then, while a move of one row from the busiest rank to another, or a swap of one row each, lowers the busiest
rank's work without making the other rank as busy, the best such exchange is made (each one strictly lowers the sum
of squared loads, so this ends). Its figure of merit is idle_fraction = 1 - total work / (dp * the busiest rank's
work): the share of the job's slots that ranks spend waiting for the busiest one (0 = perfectly balanced), weighted
by FLOPs when the work is FLOPs, by core passes when it is depths.
"""
from __future__ import annotations

import heapq
import operator

import numpy as np

from megaloop.depth.bucketing import _depth_array, assign_buckets_to_ranks, bucket_microbatches


def _check_dp(dp) -> int:
    dp = operator.index(dp)
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")
    return dp


def row_costs(n, k, non_loop: int, step_nograd: int, step_grad: int) -> np.ndarray:
    """Each row's whole cost, non_loop + n * step_nograd + k * step_grad (int64; the coefficients are integers,
    e.g. FLOPs per token, so the sums are exact and every rank deals alike)."""
    n, k = _depth_array(n), _depth_array(k)
    coeffs = [operator.index(c) for c in (non_loop, step_nograd, step_grad)]
    if n.shape != k.shape or min(coeffs) < 0:
        raise ValueError(f"row_costs needs n and k of one shape and coefficients >= 0, got {n.shape}, {k.shape}, "
                         f"{coeffs}")
    return coeffs[0] + n * coeffs[1] + k * coeffs[2]


def deal_by_depth(depths, dp: int, costs=None) -> list[np.ndarray]:
    """Positions of the global batch held by each of `dp` ranks, balanced by the sum of their rows' `costs`
    (integers, e.g. `row_costs`; None: the depths themselves, i.e. loop passes only).

    A pure function of (depths, dp, costs): every rank computes the same dealing. Each rank's positions come back in
    increasing order; together they are a permutation of range(len(depths)).
    """
    depth_arr, dp = _depth_array(depths if costs is None else costs), _check_dp(dp)
    if costs is not None and depth_arr.shape != _depth_array(depths).shape:
        raise ValueError(f"costs must give one cost per row: {depth_arr.shape} costs for "
                         f"{_depth_array(depths).shape} depths")
    if depth_arr.size < dp:
        raise ValueError(f"a global batch of {depth_arr.size} sequences cannot give every one of dp={dp} ranks a "
                         "row; raise data.global_batch_size to at least dp")
    order = np.lexsort((np.arange(depth_arr.size), -depth_arr))  # costliest first, ties by position
    heap = [(0, 0, rank) for rank in range(dp)]  # (work, rows, rank): the least loaded rank on top
    owned: list[list[int]] = [[] for _ in range(dp)]
    for position in order.tolist():
        work, rows, rank = heapq.heappop(heap)
        owned[rank].append(position)
        heapq.heappush(heap, (work + int(depth_arr[position]), rows + 1, rank))
    while _improve_busiest(depth_arr, owned):
        pass
    return [np.sort(np.asarray(mine, dtype=np.int64)) for mine in owned]


def _improve_busiest(depth_arr: np.ndarray, owned: list[list[int]]) -> bool:
    """Make the exchange (a move or a swap of one row each) between the busiest rank and another that lowers the
    busiest rank's work most while leaving the other below its old work; False when there is none. Deterministic:
    ties go to the first rank, row and partner row in order."""
    loads = [int(depth_arr[mine].sum()) for mine in owned]
    busiest = max(range(len(owned)), key=lambda r: (loads[r], -r))
    best, best_key = None, None
    for other in range(len(owned)):
        room = loads[busiest] - loads[other]  # an exchange moving delta in (0, room) of work helps
        if other == busiest or room <= 1:
            continue
        for i, x in enumerate(owned[busiest]):
            for j, y in enumerate([None, *owned[other]]):
                delta = int(depth_arr[x]) - (0 if y is None else int(depth_arr[y]))
                if 0 < delta < room:
                    key = (max(loads[busiest] - delta, loads[other] + delta), other, i, j)
                    if best_key is None or key < best_key:
                        best, best_key = (other, i, j - 1), key
    if best is None:
        return False
    other, i, j = best
    x = owned[busiest].pop(i)
    if j >= 0:
        owned[busiest].append(owned[other].pop(j))
    owned[other].append(x)
    return True


def deal_by_rows(depths, dp: int, micro_batch_size: int) -> list[np.ndarray]:
    """Equal rows and micro-batch counts per rank: depth buckets of the global batch dealt by
    `assign_buckets_to_ranks` (the DeepSpeed engine's fixed accumulation count). Positions in increasing order."""
    buckets = bucket_microbatches(depths, micro_batch_size)
    return [np.sort(np.concatenate(mine)) for mine in assign_buckets_to_ranks(buckets, _check_dp(dp), depths)]


def split_rank_rows(depths, micro_batch_size: int, by_depth: bool = True) -> list[np.ndarray]:
    """One rank's rows (indices into `depths`, the depths of its rows in order) cut into micro-batches of at most
    `micro_batch_size`: sorted by depth (stable: ties keep their order) when `by_depth`, else in order. Each
    micro-batch's indices come back in increasing order."""
    depth_arr = _depth_array(depths)
    micro_batch_size = operator.index(micro_batch_size)
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    order = np.argsort(depth_arr, kind="stable") if by_depth else np.arange(depth_arr.size)
    return [np.sort(order[start:start + micro_batch_size]) for start in range(0, depth_arr.size, micro_batch_size)]


def idle_fraction(total_work: float, rank_work) -> float:
    """1 - total_work / (dp * max(rank_work)): the share of slots spent waiting for the busiest rank.
    `total_work` is the useful work (sum of depths, or of FLOPs), `rank_work` each rank's executed work (same unit)."""
    busiest = max(rank_work) if len(rank_work) else 0
    return 1.0 - total_work / (len(rank_work) * busiest) if busiest > 0 else 0.0
