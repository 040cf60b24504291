"""The ring pipeline's plan (parallel.pp > 1): per-stage parameters, gradients, optimizer state and stored
activations, and the simulated schedule of one optimizer step.

Stages: ring rank s holds the core blocks the model's stage program gives it (megaloop.model.stages.stage_ranges
with parallel.pp_split: contiguous; "even": the earlier stages one more when pp does not divide n_core; "balanced":
fewer on the end stages); rank 0 also the embedding, the prelude, the prelude norm and the injection; the last rank C, the coda, the final norm and the head, which is the
tied embedding, so the embedding is counted on both. A value embedding sits on the stage of the layer that uses it.
Gradients and optimizer state are `static_terms` of the stage's parameters on its tp x dp ranks.

Schedule: the micro-batches of data-parallel rank 0 at step 0, as the trainer deals and cuts them
(`megaloop.train.data.rank_selection`, `split_rank_rows`), their depths drawn by the config's sampler: a
micro-batch makes laps = its deepest sequence's depth, the last min(laps, mu_bwd) with autograd, and lap l runs
the fraction of its rows with depth >= laps - l (the ragged loop, aligned at the end). Costs, relative to one
forward lap segment of the largest stage (1 unit; backward 2 units): embed = the prelude's forward FLOPs, loss =
C's, the coda's and the head's, each over the segment's (2 x matmul weights + 4 d s attention per token; backward
twice the forward). The ring schedule runs under a bound of `in_flight` x pp micro-batches in flight (twice that
open; 3 by default, as benchmarks/ring_schedule.py) and is simulated.

Stored activations per rank: the simulator's peak stored units x one lap segment's stored bytes on that rank under
train.activation_checkpointing (`activations.block_bytes`), and, replaying the simulated run with each unit at its
own size, the peak stored bytes: a kept lap segment as above, an Embed the prelude (kept in full in every setting),
the token ids, the prelude norm and the injection's term of e, a Loss C's input, the coda, the final norm, the
head's input and the fp32 logits with the saved softmax. Not counted: the value embeddings of core layers, the
loss's backward transients and the optimizer step's working memory.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from megaloop.config import Config, ConfigError
from megaloop.config.sections import ParallelConfig
from megaloop.model.block import has_value_embedding
from megaloop.model.stages import stage_ranges
from megaloop.plan.activations import (
    Sizes,
    _stack_bytes,
    block_bytes,
    block_input_bytes,
    injection_bytes,
    input_term_bytes,
)
from megaloop.plan.layout import Layout, LocalParam
from megaloop.plan.static import StaticTerms, static_terms
from pipeline.ring import (
    Backward,
    CostModel,
    Embed,
    EmbedBackward,
    Forward,
    Loss,
    LossBackward,
    MicroBatch,
    SimResult,
    ring_schedule,
    simulate,
)

IN_FLIGHT_PER_STAGE = ParallelConfig.pp_in_flight  # the bound: this many times pp micro-batches in flight
FIRST = ("embed.", "prelude.", "prelude_norm.", "injection.")
LAST = ("embed.", "C.", "coda.", "final_norm.")


@dataclass(frozen=True)
class StagePlan:
    """One ring rank: its core blocks [first, end), parameter count, static memory, idle fraction, peak stored
    units with the bytes of one lap segment's unit, and the peak stored bytes with each unit at its own size."""

    rank: int
    core_blocks: tuple[int, int]
    n_params: int
    static: StaticTerms
    idle: float
    peak_units: int
    unit_bytes: int
    stored_bytes: int

    @property
    def activations(self) -> int:
        """Peak stored units x one lap segment's bytes."""
        return self.peak_units * self.unit_bytes

    @property
    def total(self) -> int:
        """Parameters, gradients, optimizer state and the peak stored bytes."""
        return self.static.persistent + self.stored_bytes


@dataclass(frozen=True)
class PipelinePlan:
    """The schedule of one optimizer step on the ring and every stage's figures."""

    specs: tuple[MicroBatch, ...]
    costs: CostModel
    max_in_flight: int
    result: SimResult
    stages: tuple[StagePlan, ...]

    @property
    def mean_laps(self) -> float:
        return float(np.mean([s.laps for s in self.specs]))

    @property
    def interleaved_idle(self) -> float:
        """Interleaved 1F1B's (p - 1) / (v m) with v = the mean lap count."""
        return (len(self.stages) - 1) / (self.mean_laps * len(self.specs))


def core_ranges(cfg: Config, pp: int) -> list[tuple[int, int]]:
    """Core blocks [first, end) of each stage, as the model's stage program splits them."""
    return [(first, last + 1) for first, last in stage_ranges(cfg.model, pp, cfg.parallel.pp_split)]


def _stages_of(name: str, cfg: Config, ranges: list[tuple[int, int]]) -> list[int]:
    m, pp = cfg.model, len(ranges)
    parts = name.split(".")
    layer = int(parts[1]) - m.n_prelude if parts[0] == "value_embeds" else None
    if parts[0] == "core":
        layer = int(parts[1])
    if layer is not None:
        if layer < 0:
            return [0]
        if layer >= m.n_core:
            return [pp - 1]
        return [s for s, (first, end) in enumerate(ranges) if first <= layer < end]
    stages = ([0] if name.startswith(FIRST) else []) + ([pp - 1] if name.startswith(LAST) else [])
    if not stages:
        raise ConfigError("parallel.pp", pp, f"the planner does not know which pipeline stage holds parameter "
                          f"{name}; plan with --pp 1")
    return stages


def stage_params(params: list[LocalParam], cfg: Config, pp: int) -> list[list[LocalParam]]:
    """Each stage's parameters (see the module docstring; the tied embedding on the first and the last)."""
    ranges = core_ranges(cfg, pp)
    stages: list[list[LocalParam]] = [[] for _ in range(pp)]
    for p in params:
        for s in _stages_of(p.name, cfg, ranges):
            stages[s].append(p)
    return stages


def micro_batch_specs(cfg: Config, dp: int) -> list[MicroBatch]:
    """Data-parallel rank 0's micro-batches at step 0 (see the module docstring)."""
    from megaloop.depth import make_sampler
    from megaloop.depth.balance import split_rank_rows
    from megaloop.train.data import rank_selection

    m, g = cfg.model, cfg.data.global_batch_size
    sampler = make_sampler(m.depth_sampler, m.mu_rec, m.backprop_depth, seed=cfg.train.seed)
    depths = sampler.sample(0, np.arange(g)).T.numpy()
    select = rank_selection(cfg, 0, dp)
    rows = np.arange(g // dp) if select is None else select(0, np.arange(g))
    mine = depths[rows] if m.is_looped else np.ones(len(rows), dtype=np.int64)
    specs = []
    for mb in split_rank_rows(mine, cfg.data.micro_batch_size, cfg.train.bucket_depths):
        d = mine[mb]
        laps = int(d.max())
        grad = min(laps, m.backprop_depth) if m.is_looped else 1
        specs.append(MicroBatch(laps, grad, tuple(float((d >= laps - lap).mean()) for lap in range(laps))))
    return specs


def _forward_flops(params: list[LocalParam], prefixes: tuple[str, ...], layers: int, cfg: Config) -> float:
    """Forward FLOPs per token of the matmul weights whose names start with `prefixes` plus `layers` attentions."""
    matmuls = sum(p.full_numel for p in params if p.name.startswith(prefixes) and len(p.full_shape) == 2
                  and not p.name.startswith("value_embeds."))
    return 2 * matmuls + 4 * cfg.model.d_model * cfg.model.seq_len * layers


def stage_costs(params: list[LocalParam], cfg: Config, ranges: list[tuple[int, int]]) -> CostModel:
    """Action costs in units of the largest stage's forward lap segment (see the module docstring)."""
    m = cfg.model
    segments = []
    for s, (first, end) in enumerate(ranges):
        prefixes = tuple(f"core.{j}." for j in range(first, end)) + (("injection.",) if s == 0 else ())
        segments.append(_forward_flops(params, prefixes, end - first, cfg))
    unit = max(segments)
    embed = _forward_flops(params, ("prelude.",), m.n_prelude, cfg) / unit
    head = 2 * m.vocab_size * m.d_model
    loss = (_forward_flops(params, ("C.", "coda."), m.n_coda, cfg) + head) / unit
    return CostModel(forward=1.0, backward=2.0, nograd_forward=1.0, embed=embed, embed_backward=2 * embed,
                     loss=loss, loss_backward=2 * loss)


def unit_bytes(cfg: Config, layout: Layout, stage: int, blocks: tuple[int, int]) -> int:
    """One lap segment's stored activations on `stage` at data.micro_batch_size under the config's checkpointing."""
    m = cfg.model
    z = Sizes.of(cfg, cfg.data.micro_batch_size, layout.tp, layout.sp)
    inject = injection_bytes(z, m) if stage == 0 else 0
    ck = cfg.train.activation_checkpointing
    if ck == "lap":
        return block_input_bytes(z)
    if ck == "block":
        return inject + (blocks[1] - blocks[0]) * block_input_bytes(z)
    layers = range(m.n_prelude + blocks[0], m.n_prelude + blocks[1])
    return inject + sum(block_bytes(z, m, m.value_embeds and has_value_embedding(i, m.n_layers)) for i in layers)


def end_bytes(cfg: Config, layout: Layout) -> tuple[int, int]:
    """What an Embed (rank 0) and a Loss (the last rank) store for one micro-batch (see the module docstring)."""
    m = cfg.model
    z = Sizes.of(cfg, cfg.data.micro_batch_size, layout.tp, layout.sp)
    norm = z.split(2 * z.act * z.d + z.act)
    embed = z.full(8) + _stack_bytes(z, m, range(m.n_prelude)) + (norm if m.prelude_norm else 0)
    embed += input_term_bytes(z, m)
    loss = _stack_bytes(z, m, range(m.n_prelude + m.n_core, m.n_layers)) + norm + z.full(z.mm * z.d)
    loss += (z.split(z.mm * z.d) if m.use_C else 0) + z.full(2 * z.act * z.vocab)
    return embed, loss


def peak_stored_bytes(result: SimResult, segments: list[int], embed: int, loss: int) -> list[int]:
    """Per rank, the most bytes stored at once when the simulated run is replayed with each stored unit at its own
    size: `segments[r]` for a kept lap segment on rank r, `embed` for an Embed, `loss` for a Loss."""
    pp = len(segments)
    sizes = {Embed: embed, EmbedBackward: -embed, Loss: loss, LossBackward: -loss}
    live, peak = [0] * pp, [0] * pp
    for rank, _, _, action in result.intervals:  # each rank's actions in its execution order
        if isinstance(action, (Forward, Backward)):
            stores = isinstance(action, Backward) or action.grad
            change = (-1 if isinstance(action, Backward) else 1) * segments[rank] * stores
        else:
            change = sizes[type(action)]
        live[rank] += change
        peak[rank] = max(peak[rank], live[rank])
    return peak


def pipeline_plan(cfg: Config, layout: Layout, params: list[LocalParam],
                  in_flight: int = IN_FLIGHT_PER_STAGE) -> PipelinePlan:
    """Stages, schedule and simulation of `cfg` on `layout` (pp > 1) with at most `in_flight` x pp micro-batches in
    flight; `params`: every parameter at its tensor-parallel shape."""
    pp = layout.pp
    ranges = core_ranges(cfg, pp)
    specs = micro_batch_specs(cfg, layout.dp)
    costs = stage_costs(params, cfg, ranges)
    bound = in_flight * pp
    result = simulate(ring_schedule(specs, pp, bound, 2 * bound, costs), specs, costs, bound, 2 * bound)
    units = [unit_bytes(cfg, layout, s, ranges[s]) for s in range(pp)]
    stored = peak_stored_bytes(result, units, *end_bytes(cfg, layout))
    stages = []
    for s, mine in enumerate(stage_params(params, cfg, pp)):
        static = static_terms(mine, layout, cfg.train.precision, cfg.parallel.zero_offload,
                              cfg.parallel.grad_bucket_elements, cfg.parallel.grad_buckets)
        stages.append(StagePlan(s, ranges[s], sum(p.local_numel for p in mine), static, result.idle_fractions[s],
                                result.peak_stored[s], units[s], stored[s]))
    return PipelinePlan(tuple(specs), costs, bound, result, tuple(stages))
