"""Loop-depth sampling, depth-bucketed micro-batching and the seeded initial state h_0.

Everything here is a pure function of (seed, step, global sample indices) or of a global batch's depths, so
changing the parallel layout or the micro-batching never changes which depth or h_0 a sequence gets.
"""
from megaloop.depth.balance import deal_by_depth, deal_by_rows, idle_fraction, split_rank_rows
from megaloop.depth.bucketing import (
    MicrobatchingCost,
    assign_buckets_to_ranks,
    bucket_microbatches,
    bucketed_cost,
    contiguous_cost,
    contiguous_microbatches,
    executed_core_passes,
    executed_to_useful_ratio,
    microbatching_cost,
    plan_rank_microbatches,
    rank_executed_passes,
)
from megaloop.depth.initial_state import initial_state
from megaloop.depth.poisson import poisson_inverse_cdf
from megaloop.depth.samplers import (
    SAMPLERS,
    DepthSample,
    DepthSampler,
    fixed_eval_depth,
    make_sampler,
    split_depth,
)

__all__ = [
    "SAMPLERS", "DepthSample", "DepthSampler", "MicrobatchingCost", "assign_buckets_to_ranks",
    "bucket_microbatches", "bucketed_cost", "contiguous_cost", "contiguous_microbatches", "deal_by_depth",
    "deal_by_rows", "executed_core_passes", "executed_to_useful_ratio", "fixed_eval_depth", "idle_fraction",
    "initial_state", "make_sampler", "microbatching_cost", "plan_rank_microbatches", "poisson_inverse_cdf",
    "rank_executed_passes", "split_depth", "split_rank_rows",
]
