"""Depth-bucketed micro-batching: target figures, permutation, optimality (brute force), rank assignment."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megaloop.depth import (
    assign_buckets_to_ranks,
    bucket_microbatches,
    bucketed_cost,
    contiguous_cost,
    contiguous_microbatches,
    executed_core_passes,
    executed_to_useful_ratio,
    make_sampler,
    plan_rank_microbatches,
    rank_executed_passes,
)

MU_REC, MICRO_BATCH, GLOBAL_BATCH, STEPS = 8, 32, 256, 500


def test_executed_passes_ratio_meets_target():
    """poisson-truncated-full, mu_rec 8, micro-batch 32, global batch 256, averaged over 500 steps."""
    sampler = make_sampler("poisson-truncated-full", MU_REC, seed=0)
    plain, bucketed = [], []
    for step in range(STEPS):
        depths = sampler.sample(step, step * GLOBAL_BATCH + np.arange(GLOBAL_BATCH)).T
        plain.append(contiguous_cost(depths, MICRO_BATCH).ratio)
        bucketed.append(bucketed_cost(depths, MICRO_BATCH).ratio)
    plain_mean, bucketed_mean = float(np.mean(plain)), float(np.mean(bucketed))
    print(f"\nexecuted core passes / sum of depths over {STEPS} steps: plain {plain_mean:.4f}, "
          f"bucketed {bucketed_mean:.4f}")
    assert plain_mean > 1.5
    assert bucketed_mean <= 1.15
    assert all(b <= p for b, p in zip(bucketed, plain))


def test_bucketing_is_a_permutation_preserving_depths():
    sampler = make_sampler("poisson-truncated-full", MU_REC, seed=9)
    sample = sampler.sample(4, 4 * GLOBAL_BATCH + np.arange(GLOBAL_BATCH))
    buckets = bucket_microbatches(sample.T, MICRO_BATCH)
    assert [len(b) for b in buckets] == [MICRO_BATCH] * (GLOBAL_BATCH // MICRO_BATCH)
    assert np.array_equal(np.sort(np.concatenate(buckets)), np.arange(GLOBAL_BATCH))
    pairs = sorted((int(i), int(t)) for b in buckets for i, t in zip(b, sample.select(b).T))
    assert pairs == [(i, int(t)) for i, t in enumerate(sample.T)]
    maxima = [int(sample.T[b].max()) for b in buckets]
    assert maxima == sorted(maxima)
    again = bucket_microbatches(sample.T.numpy().copy(), MICRO_BATCH)
    assert all(np.array_equal(a, b) for a, b in zip(buckets, again))


def _equal_partitions(items: tuple[int, ...], size: int):
    """All partitions of `items` into unordered groups of `size`."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for others in itertools.combinations(rest, size - 1):
        remaining = tuple(x for x in rest if x not in others)
        for tail in _equal_partitions(remaining, size):
            yield [(first, *others)] + tail


@pytest.mark.parametrize("batch,micro", [(4, 2), (6, 2), (6, 3), (8, 2), (8, 4), (9, 3), (10, 2)])
def test_sorted_chunks_are_optimal_by_brute_force(batch, micro):
    rng = np.random.default_rng(batch * 100 + micro)
    for trial in range(12):
        depths = rng.integers(1, 6 if trial % 2 else 20, size=batch)
        best = min(executed_core_passes(depths, [np.array(g) for g in groups])
                   for groups in _equal_partitions(tuple(range(batch)), micro))
        assert executed_core_passes(depths, bucket_microbatches(depths, micro)) == best


def test_brute_force_sees_that_contiguous_is_not_optimal():
    """Guards the brute-force test's power: on this batch contiguous chunks cost more than the optimum."""
    depths = np.array([1, 9, 1, 9])
    assert executed_core_passes(depths, contiguous_microbatches(4, 2)) == 36
    assert executed_core_passes(depths, bucket_microbatches(depths, 2)) == 20


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6).flatmap(lambda micro: st.tuples(
    st.just(micro), st.integers(1, 6).flatmap(lambda count: st.lists(
        st.integers(1, 40), min_size=micro * count, max_size=micro * count)))),
    st.integers(0, 2 ** 32 - 1))
def test_bucketed_never_worse_than_any_chunking(case, seed):
    micro, depths = case
    depths = np.array(depths)
    bucketed = executed_core_passes(depths, bucket_microbatches(depths, micro))
    assert bucketed <= executed_core_passes(depths, contiguous_microbatches(depths.size, micro))
    shuffled = np.random.default_rng(seed).permutation(depths.size)
    random_chunks = [shuffled[i:i + micro] for i in range(0, depths.size, micro)]
    assert bucketed <= executed_core_passes(depths, random_chunks)
    assert bucketed >= depths.sum()


def test_cost_figures():
    depths = torch.tensor([2, 8, 3, 1])
    assert executed_core_passes(depths, contiguous_microbatches(4, 2)) == 16 + 6
    assert executed_to_useful_ratio(depths, contiguous_microbatches(4, 2)) == pytest.approx(22 / 14)
    cost = bucketed_cost(depths, 2)
    assert (cost.executed, cost.useful) == (2 * 2 + 8 * 2, 14)


def test_invalid_sizes_are_reported():
    with pytest.raises(ValueError, match="micro_batch_size"):
        bucket_microbatches([1, 2, 3], 2)
    with pytest.raises(ValueError, match="micro_batch_size"):
        contiguous_microbatches(4, 0)
    with pytest.raises(ValueError, match="1-D"):
        bucket_microbatches([[1, 2]], 1)
    with pytest.raises(ValueError, match="dp"):
        assign_buckets_to_ranks(bucket_microbatches([1, 2, 3], 1), 2, [1, 2, 3])


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_rank_assignment_is_balanced_and_complete(dp):
    sampler = make_sampler("poisson-truncated-full", MU_REC, seed=3)
    for step in range(20):
        depths = sampler.sample(step, step * GLOBAL_BATCH + np.arange(GLOBAL_BATCH)).T
        plan = plan_rank_microbatches(depths, MICRO_BATCH, dp)
        assert len(plan) == dp and all(len(mbs) == GLOBAL_BATCH // MICRO_BATCH // dp for mbs in plan)
        owned = np.sort(np.concatenate([mb for mbs in plan for mb in mbs]))
        assert np.array_equal(owned, np.arange(GLOBAL_BATCH))
        loads = rank_executed_passes(depths, plan)
        assert sum(loads) == bucketed_cost(depths, MICRO_BATCH).executed
        largest_bucket = max(int(depths[b].max()) * len(b) for b in bucket_microbatches(depths, MICRO_BATCH))
        assert max(loads) - min(loads) <= largest_bucket


def test_every_rank_computes_the_same_plan():
    """Each rank re-derives the global batch's depths from the sampler and gets an identical plan."""
    sampler = make_sampler("poisson-truncated-full", MU_REC, seed=5)
    step, indices = 17, 17 * GLOBAL_BATCH + np.arange(GLOBAL_BATCH)
    plans = []
    for rank in range(4):
        rank_sampler = make_sampler("poisson-truncated-full", MU_REC, seed=5)
        order = np.random.default_rng(rank).permutation(GLOBAL_BATCH)
        depths = np.empty(GLOBAL_BATCH, dtype=np.int64)
        depths[order] = rank_sampler.sample(step, indices[order]).T.numpy()
        plans.append(plan_rank_microbatches(depths, MICRO_BATCH, 4))
    reference = plan_rank_microbatches(sampler.sample(step, indices).T, MICRO_BATCH, 4)
    for plan in plans:
        assert all(np.array_equal(a, b) for mine, ref in zip(plan, reference) for a, b in zip(mine, ref))


def test_greedy_balances_a_skewed_case():
    depths = np.array([10, 10, 1, 1, 9, 9, 2, 2])
    plan = assign_buckets_to_ranks(bucket_microbatches(depths, 2), 2, depths)
    # bucket costs 2, 4, 18, 20: longest-first gives 20 -> rank 0, 18 -> rank 1, 4 -> rank 1, 2 -> rank 0
    assert rank_executed_passes(depths, plan) == [22, 22]
    assert [len(mbs) for mbs in plan] == [2, 2]
