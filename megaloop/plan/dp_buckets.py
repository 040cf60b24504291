"""The data-parallel buckets the trainer will build, and when each can go on the wire, for the time planner.

The gradient buffer's groups and their column-range buckets come from the functions the runtime lays out with
(pipeline.grad_buffer.layout_groups, pipeline.data_parallel.bucket_members), fed with the same parameters in the same
order (pipeline.grad_buffer.gradient_order: the reverse of the model's order, the embedding lookups last), the same
Muon owners (pipeline.dist_muon.assign_owners) and parallel.grad_buckets. So the planner sees the sizes, the order
and the members of every bucket the code reduces.

When a bucket is ready, and when the next forward needs it, is modelled from where its members' work lies:

  backward  the last micro-batch's backward runs the tied head first (its share of the embedding's gradient), then
            the parameters in gradient order, each taking a share of the backward proportional to elements x uses
            (a core block's parameters are used once per gradient lap: model.backprop_depth; the injection and C
            too); a bucket is ready when its last member's share is done. The lookups' gradients are final at the
            very end (ready = 1).
  forward   the next step's first forward reads the lookups first (need = 0), then the parameters in model order,
            each taking a share proportional to elements x uses (mu_rec laps for the core); a bucket is needed when
            its first member is.

Attention's sequence-squared work, the loss and elementwise work are not spread: they are assumed to follow the
parameters' shares.
"""
from __future__ import annotations

from dataclasses import dataclass

from megaloop.plan.layout import LocalParam
from pipeline.data_parallel import bucket_members
from pipeline.dist_muon import assign_owners
from pipeline.grad_buffer import Entry, layout_groups

LOOPED = ("core.", "injection.", "C.")  # run once per lap


@dataclass(frozen=True)
class PlannedBucket:
    """One bucket: elements of its collective's whole tensor (columns x chunks), the fraction of the last backward
    done when it is ready, the fraction of the next forward done when it is first needed, and whether it belongs to
    the lookups' groups."""

    elements: int
    ready: float
    need: float
    late: bool
    whole: bool = False  # the bucket is its group's whole buffer (reduced in place, no copy)
    lookups: bool = False  # a lookup's parameter has columns in it: it waits for the end of backward


def _uses(p: LocalParam, laps: int) -> int:
    return laps if p.name.startswith(LOOPED) else 1


def _shares(params: list[LocalParam], laps: int, head_first: bool) -> dict[str, float]:
    """name -> fraction of the pass done when the parameter's work ends (backward: in gradient order after the
    head; forward: in model order, as the start of its work)."""
    weight = {p.name: (0 if p.lookup else p.local_numel * _uses(p, laps)) for p in params}
    head = sum(p.local_numel for p in params if p.lookup and p.name.startswith("embed."))  # the tied head
    total = sum(weight.values()) + head or 1
    out, done = {}, 0.0
    if head_first:
        done = head
        for p in params[::-1]:
            if not p.lookup:
                done += weight[p.name]
                out[p.name] = done / total
        out.update({p.name: 1.0 for p in params if p.lookup})
        return out
    for p in params:
        out[p.name] = 0.0 if p.lookup else done / total
        done += weight[p.name]
    return out


def _owners(params: list[LocalParam], dp: int, tp: int, sharded: bool) -> dict[str, int]:
    """The data-parallel chunk of every Muon matrix (as DistributedMuon: owners over dp x tp slots by full size)."""
    matrices = [p for p in params if p.optimizer == "muon"]
    if not sharded or not matrices:
        return {}
    slots = assign_owners([p.full_numel for p in matrices], dp * tp)
    return {p.name: slot // tp for p, slot in zip(matrices, slots)}


def planned_groups(params: list[LocalParam], dp: int, tp: int, sharded: bool, grad_buckets: str) -> list:
    """The gradient buffer's groups (pipeline.grad_buffer.GroupLayout) of a rank holding `params` (model order);
    `sharded`: ZeRO-1 (dp chunks), else one chunk."""
    chunks = dp if sharded else 1
    owners = _owners(params, dp, tp, sharded)
    if grad_buckets == "columns":  # the earlier order: Muon matrices, then AdamW parameters, model order each
        ordered = [p for p in params if p.optimizer == "muon"] + [p for p in params if p.optimizer != "muon"]
        late = set()
    else:
        ordered = sorted(params[::-1], key=lambda p: p.lookup)
        late = {p.name for p in params if p.lookup}
    entries = [Entry(p.name, p.local_numel, "fp", owners.get(p.name), p.name in late) for p in ordered]
    return layout_groups(entries, chunks, grad_buckets)


def planned_buckets(params: list[LocalParam], dp: int, tp: int, sharded: bool, bucket_elements: int,
                    grad_buckets: str, mu_rec: int, backprop_depth: int) -> list[PlannedBucket]:
    """The buckets of a rank holding `params` (model order), in the order the reducer launches them; `sharded`:
    ZeRO-1 (dp chunks, reduce-scatter), else one chunk (all-reduce)."""
    ready = _shares(params, backprop_depth, head_first=True)
    need = _shares(params, mu_rec, head_first=False)
    out, lookup = [], {p.name for p in params if p.lookup}
    for group in planned_groups(params, dp, tp, sharded, grad_buckets):
        for lo, hi, members in bucket_members(group, bucket_elements):
            names = [group.names[i] for i in members]
            out.append(PlannedBucket((hi - lo) * group.dp, max((ready[n] for n in names), default=0.0),
                                     min((need[n] for n in names), default=1.0), group.late,
                                     hi - lo == group.chunk_len, any(n in lookup for n in names)))
    return out


def chunk_elements(params: list[LocalParam], dp: int, tp: int, sharded: bool, grad_buckets: str,
                   optimizer: str | None = None) -> list[int]:
    """Elements in each data-parallel chunk of the rank's gradient buffer (one chunk unless sharded): padding
    included (optimizer None), or only those of the parameters with that optimizer."""
    groups = planned_groups(params, dp, tp, sharded, grad_buckets)
    chunks = groups[0].dp if groups else 1
    if optimizer is None:
        return [sum(g.chunk_len for g in groups)] * chunks
    which = {p.name for p in params if p.optimizer == optimizer}
    out = [0] * chunks
    for g in groups:
        for name, n, off in zip(g.names, g.numels, g.offsets):
            if name in which:
                for r in range(chunks):
                    out[r] += max(0, min(off + n, (r + 1) * g.chunk_len) - max(off, r * g.chunk_len))
    return out
