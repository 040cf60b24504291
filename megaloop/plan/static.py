"""Per-rank memory that does not depend on the micro-batch: parameters, gradients, optimizer state, and the
optimizer step's own working memory.

  parameters   this rank's tensor-parallel shards (fp32; fp64 under train.precision=fp64) in the flat buffers of
               the gradient buffer's layout, padding included (megaloop/plan/dp_buckets.py runs the runtime's
               layout); DeepSpeed ZeRO-3: 1/dp
  gradients    one copy of those flat buffers in the parameter dtype; DeepSpeed ZeRO-2/3: this rank's 1/dp
               partition plus one reduction bucket
  Muon         momentum [rows, cols] and NorMuon's second moment [rows, 1] or [1, cols], at least fp32, for the
               matrices this rank owns: all of them in one process; under tp > 1 or ZeRO-1 with dp > 1 the
               distributed Muon assigns whole matrices to the dp x tp ranks (pipeline.dist_muon.assign_owners) and
               the most loaded rank is reported
  AdamW        exp_avg and exp_avg_sq in the parameter dtype; ZeRO-1 (native, dp > 1): for the AdamW elements of
               this rank's chunk of the gradient buffer (pipeline/grad_buffer.py, laid out as the runtime does);
               the most loaded chunk is reported; DeepSpeed: 1/dp plus its fp32 partition (on the CPU with
               parallel.zero_offload)
  dp in flight the data-parallel buckets alive at once (pipeline/data_parallel.py): at most MAX_IN_FLIGHT of the
               largest planned bucket (max(40M, 1M x dp) elements or parallel.grad_bucket_elements) in the
               parameter dtype, a copy each when a bucket is a column range narrower than its group's chunk (none
               when one bucket holds it); the reducer's during the last backward, the parameter all-gather's during
               the next forward (overlap_param_gather), so they are counted on top of the activations
  step working the optimizer step's largest temporaries: the data-parallel reduction's buckets in flight,
               the AdamW step over this rank's chunk, the distributed Muon's gathered gradients and updates (up to
               one copy of the local Muon matrices) and Polar Express on the largest matrix
"""
from __future__ import annotations

from dataclasses import dataclass

from megaloop.plan.layout import Layout, LocalParam
from megaloop.plan.dp_buckets import chunk_elements, planned_buckets
from pipeline.data_parallel import MAX_IN_FLIGHT, default_bucket_elements
from pipeline.dist_muon import assign_owners

DEEPSPEED_BUCKET_ELEMENTS = 500_000_000  # DeepSpeed's default reduce/allgather bucket (elements)
DEEPSPEED_PREFETCH_ELEMENTS = 50_000_000  # ZeRO-3's default prefetch bucket (elements)


@dataclass(frozen=True)
class StaticTerms:
    params: int
    grads: int
    muon: int
    adamw: int
    step_working: int
    dp_in_flight: int = 0  # bucket copies alive during the backward / the next forward

    @property
    def persistent(self) -> int:
        return self.params + self.grads + self.muon + self.adamw


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _muon_state(shape: tuple[int, ...]) -> int:
    rows, cols = shape
    return rows * cols + (rows if rows >= cols else cols)


def optimizer_state_elements(params: list[LocalParam], layout: Layout,
                             grad_buckets: str = "backward") -> tuple[int, int]:
    """(Muon, AdamW) state elements of the most loaded rank under the native engine (see the module docstring)."""
    matrices = [p for p in params if p.optimizer == "muon"]
    n_adamw = sum(p.local_numel for p in params if p.optimizer == "adamw")
    sharded = layout.zero_stage >= 1 and layout.dp > 1
    if not matrices or not (layout.tp > 1 or sharded):
        return sum(_muon_state(p.full_shape) for p in matrices), 2 * n_adamw
    dp_slots = layout.dp if sharded else 1
    owners = assign_owners([p.full_numel for p in matrices], dp_slots * layout.tp)
    muon = [0] * (dp_slots * layout.tp)
    pinned = [0] * dp_slots  # local Muon elements lying in each data-parallel chunk of the gradient buffer
    for p, slot in zip(matrices, owners):
        muon[slot] += _muon_state(p.full_shape)
        pinned[slot // layout.tp] += p.local_numel
    if not sharded:
        return max(muon), 2 * n_adamw
    adamw = chunk_elements(params, layout.dp, layout.tp, True, grad_buckets, "adamw")
    ranks = [(muon[slot], 2 * adamw[slot // layout.tp]) for slot in range(len(muon))]
    return max(ranks, key=sum)


def dp_in_flight_bytes(params: list[LocalParam], layout: Layout, element_bytes: int,
                       bucket_elements: int | None = None, grad_buckets: str = "backward") -> int:
    """Bytes of the data-parallel bucket copies alive at once (see the module docstring)."""
    if layout.dp == 1:
        return 0
    sharded = layout.zero_stage >= 1  # stage 0: one chunk, all-reduced
    buckets = planned_buckets(params, layout.dp, layout.tp, sharded,
                              bucket_elements or default_bucket_elements(layout.dp), grad_buckets, 1, 1)
    copied = [b.elements for b in buckets if not b.whole]
    return MAX_IN_FLIGHT * element_bytes * max(copied) if copied else 0


def static_terms(params: list[LocalParam], layout: Layout, precision: str, offload: bool = False,
                 bucket_elements: int | None = None, grad_buckets: str = "backward") -> StaticTerms:
    """The micro-batch-independent memory of the most loaded rank (see the module docstring)."""
    pb = 8 if precision == "fp64" else 4
    n_local = sum(p.local_numel for p in params)
    n_muon = sum(p.local_numel for p in params if p.optimizer == "muon")
    n_adamw = n_local - n_muon
    largest = max((p.full_numel for p in params if p.optimizer == "muon"), default=0)
    polar = 6 * pb * largest
    if layout.engine == "deepspeed":
        return _deepspeed_terms(n_local, layout, offload, largest_param=max(p.full_numel for p in params))
    muon, adamw = optimizer_state_elements(params, layout, grad_buckets)
    zero1 = layout.zero_stage >= 1 and layout.dp > 1
    in_flight = dp_in_flight_bytes(params, layout, pb, bucket_elements, grad_buckets)
    working = in_flight  # the data-parallel reduction's bucket copies
    if zero1:
        working = max(working, 2 * pb * _ceil_div(n_adamw, layout.dp))
    distributed_muon = muon and (layout.tp > 1 or zero1)
    working = max(working, (pb * n_muon if distributed_muon else 0) + polar)
    flat = chunk_elements(params, layout.dp, layout.tp, zero1, grad_buckets)  # the flat buffers, padding included
    held = sum(flat) if zero1 else n_local
    return StaticTerms(params=pb * held, grads=pb * held, muon=pb * muon, adamw=pb * adamw,
                       step_working=working, dp_in_flight=in_flight)


def _deepspeed_terms(n: int, layout: Layout, offload: bool, largest_param: int) -> StaticTerms:
    """DeepSpeed ZeRO 1/2/3 in fp32 (the engine runs AdamW only, tp = pp = 1), buffers at DeepSpeed's defaults."""
    dp, stage = layout.dp, layout.zero_stage
    part = _ceil_div(n, dp)
    bucket = 4 * min(DEEPSPEED_BUCKET_ELEMENTS, n)
    params = 4 * part if stage == 3 else 4 * n
    grads = 4 * n if stage == 1 else 4 * part + bucket
    adamw = 0 if offload else 3 * 4 * part  # exp_avg, exp_avg_sq and the fp32 partition
    working = 4 * min(n, DEEPSPEED_PREFETCH_ELEMENTS + 2 * largest_param) if stage == 3 else bucket
    return StaticTerms(params=params, grads=grads, muon=0, adamw=adamw, step_working=working)
