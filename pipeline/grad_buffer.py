"""Persistent flat parameter and gradient buffers, laid out so that each data-parallel rank owns one chunk.

Every parameter lives at a fixed offset of one flat parameter vector of its group and its .grad is the view at the
same offset of the group's flat gradient vector (set once: backward accumulates into it in place, and zeroing is in
place). A group's flat vectors have dp equal chunks of `chunk_len` elements; data-parallel rank r owns chunk r of
every group. With dp = 1 each group is one chunk (no sharding).

The data-parallel reduction works on column ranges of the [dp, chunk_len] view of a group (pipeline/data_parallel.py),
so a range can be sent once the gradients of all the parameters in it are final. Parameters are given in the order
backward finishes their gradients (:func:`gradient_order`), and the layout (`layout="backward"`, the default) keeps
that order along the columns:

- the lookups' parameters (the embeddings: final only when backward reaches the model's input) get their own
  groups, laid out after the others, so no range of the other groups waits for them; within them parameters are
  cut anywhere to fill the chunks evenly (no padding beyond alignment);
- in the other groups ("main"), every parameter lies whole in one chunk: a Muon matrix in its owner's (decided by
  the distributed Muon), any other in the least-filled chunk at its turn. Each chunk then holds its parameters in
  completion order from column 0, so column c of every chunk completes at about the same point of the backward.
  The price is padding at the end of the shorter chunks (up to about one parameter per chunk).

`layout="columns"` is the earlier layout, kept to measure against: one group per dtype in the given order, each
chunk [the rest of a cuttable parameter begun in chunk r-1][the parameters pinned to r][cuttable ones], cuttable
(AdamW) parameters filling every chunk and running across chunk boundaries; the embeddings then lie in most
column ranges, and every bucket waits for them.

Because the chunks are contiguous and equal, a reduce-scatter of the gradient vector hands every rank the summed
gradient of exactly what it updates, and one all-gather of the parameter vector's chunks brings every rank the
updated parameters.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

ALIGN = 16  # chunk lengths are multiples of this many elements (aligned collective buffers)
LAYOUTS = ("backward", "columns")


@dataclass(frozen=True)
class Item:
    """One parameter to place: `owner` is the chunk it must lie in whole, or None when it may be cut anywhere."""

    numel: int
    owner: int | None = None


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _place(items: list[Item], dp: int, chunk_len: int) -> tuple[list[int], int]:
    """Offsets of `items` with chunks of chunk_len, and 0; or ([], how many elements did not fit)."""
    offsets = [0] * len(items)
    pinned = [[i for i, it in enumerate(items) if it.owner == r] for r in range(dp)]
    free = [i for i, it in enumerate(items) if it.owner is None]
    carry = 0  # elements of the last cuttable item still to be laid at the start of the next chunk
    for r in range(dp):
        pos, end = r * chunk_len + carry, (r + 1) * chunk_len
        carry = max(0, pos - end)
        if carry and pinned[r]:
            return [], carry + sum(items[i].numel for i in pinned[r])
        pos = min(pos, end)
        for i in pinned[r]:
            offsets[i], pos = pos, pos + items[i].numel
        if pos > end:
            return [], pos - end
        while free and pos < end and not carry:
            i = free.pop(0)
            offsets[i], pos = pos, pos + items[i].numel
            carry = max(0, pos - end)
    left = carry + sum(items[i].numel for i in free)
    return (offsets, 0) if left == 0 else ([], left)


def plan_chunks(items: list[Item], dp: int) -> tuple[int, list[int]]:
    """(chunk_len, offset of every item): the smallest aligned chunk length this greedy placement fits."""
    if any(it.owner is not None and not 0 <= it.owner < dp for it in items):
        raise ValueError(f"an item's owner is outside the {dp} chunks")
    per_owner = [sum(it.numel for it in items if it.owner == r) for r in range(dp)]
    chunk_len = _round_up(max([-(-sum(it.numel for it in items) // dp), *per_owner, 1]), ALIGN)
    while True:
        offsets, overflow = _place(items, dp, chunk_len)
        if not overflow:
            return chunk_len, offsets
        chunk_len = _round_up(chunk_len + -(-overflow // dp), ALIGN)


@dataclass(frozen=True)
class Entry:
    """One parameter to lay out: name, elements, dtype, the chunk it must lie in whole (None: any), and whether its
    gradient is final only at the end of backward (a lookup's)."""

    name: str
    numel: int
    dtype: object
    owner: int | None = None
    late: bool = False


@dataclass(frozen=True)
class GroupLayout:
    """Where a group's parameters lie: the group's dtype and kind, and each parameter's offset (absolute, in the
    flat vector of dp chunks of chunk_len)."""

    dtype: object
    late: bool
    names: tuple[str, ...]
    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    chunk_len: int
    dp: int


def _whole_owners(entries: list[Entry], dp: int) -> list[Item]:
    """Every entry whole in one chunk: its owner, else the least-filled chunk at its turn (ties: the lowest)."""
    load, items = [0] * dp, []
    for e in entries:
        owner = e.owner if e.owner is not None else min(range(dp), key=lambda r: (load[r], r))
        load[owner] += e.numel
        items.append(Item(e.numel, owner))
    return items


def layout_groups(entries: list[Entry], dp: int, layout: str = "backward") -> list[GroupLayout]:
    """The groups of `entries` (given in gradient completion order) over dp chunks (see the module docstring):
    "backward": per dtype the main group, then per dtype the late one; "columns": one group per dtype."""
    if layout not in LAYOUTS:
        raise ValueError(f"gradient buffer layout {layout!r}: one of {', '.join(LAYOUTS)}")
    dtypes = list(dict.fromkeys(e.dtype for e in entries))
    if layout == "columns":
        kinds = [(d, None) for d in dtypes]
    else:
        kinds = [(d, late) for late in (False, True) for d in dtypes]
    out = []
    for dtype, late in kinds:
        members = [e for e in entries if e.dtype == dtype and (late is None or e.late == late)]
        if not members:
            continue
        if late is False and dp > 1:
            items = _whole_owners(members, dp)
        else:
            items = [Item(e.numel, e.owner) for e in members]
        chunk_len, offsets = plan_chunks(items, dp)
        out.append(GroupLayout(dtype, bool(late), tuple(e.name for e in members), tuple(e.numel for e in members),
                               tuple(offsets), chunk_len, dp))
    return out


def lookup_parameters(model: nn.Module) -> set[int]:
    """ids of the parameters of the model's embedding lookups (nn.Embedding and its subclasses, the
    vocabulary-parallel one included)."""
    return {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}


def gradient_order(model: nn.Module, named: list[tuple[str, torch.Tensor]]) -> tuple[list, set[str]]:
    """(`named` in the order backward finishes their gradients, the names of those finished last).

    Blocks are registered in forward order, so backward reaches later ones first: the order is the reverse of
    model.parameters(). A lookup's parameters come last: a lookup runs before every block that uses its output
    (the value embeddings are looked up once, before the prelude), so its gradient, all uses summed, is final only
    when backward reaches the input. The tied head's share of the embedding's gradient comes first, the lookup's
    last. Parameters the model does not hold keep their relative order, after the model's."""
    position = {id(p): i for i, p in enumerate(model.parameters())}
    lookups = lookup_parameters(model)
    ordered = sorted(named, key=lambda np: (id(np[1]) in lookups, -position.get(id(np[1]), -1)))
    return ordered, {n for n, p in named if id(p) in lookups}


@dataclass
class FlatGroup:
    """The parameters of one group: their names, offsets, and the flat parameter and gradient vectors; `late`:
    the lookups' group (see the module docstring)."""

    names: list[str]
    params: list[torch.Tensor]
    offsets: list[int]
    chunk_len: int
    dp: int
    param_flat: torch.Tensor
    grad_flat: torch.Tensor
    late: bool = False

    @property
    def numels(self) -> list[int]:
        return [p.numel() for p in self.params]

    def chunk(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        return flat[rank * self.chunk_len:(rank + 1) * self.chunk_len]

    def segments(self, rank: int) -> list[tuple[int, int, int]]:
        """(parameter index, start, end) of every parameter piece in chunk `rank` (absolute offsets), in order."""
        lo, hi = rank * self.chunk_len, (rank + 1) * self.chunk_len
        out = []
        for i, (p, off) in enumerate(zip(self.params, self.offsets)):
            a, b = max(lo, off), min(hi, off + p.numel())
            if a < b:
                out.append((i, a, b))
        return sorted(out, key=lambda s: s[1])


class GradBuffer:
    """Flat buffers for `named_params`, given in gradient completion order (see the module docstring), chunked
    over `dp` with this process owning chunk `rank` of every group. `owners` maps a parameter name to the chunk
    that must hold it whole; `late` names the parameters whose gradient is final only at the end of backward
    (:func:`gradient_order` gives both). The parameters' .data and .grad become views into the buffers (values are
    kept); each gradient vector is allocated after its parameters moved, so laying out holds at most the old and
    the flat parameters at once (plus any gradients that exist)."""

    def __init__(self, named_params: list[tuple[str, torch.Tensor]], dp: int = 1, rank: int = 0,
                 owners: dict[str, int] | None = None, late=(), layout: str = "backward"):
        owners, late = owners or {}, set(late)
        self.dp, self.rank, self.layout = dp, rank, layout
        named = [(n, p) for n, p in named_params if p.requires_grad]
        entries = [Entry(n, p.numel(), p.dtype, owners.get(n), n in late) for n, p in named]
        by_name = dict(named)
        self.groups = [self._make_group(g, [by_name[n] for n in g.names]) for g in layout_groups(entries, dp, layout)]

    @torch.no_grad()
    def _make_group(self, plan: GroupLayout, params: list[torch.Tensor]) -> FlatGroup:
        named, chunk_len, offsets = list(zip(plan.names, params)), plan.chunk_len, list(plan.offsets)
        like = params[0]
        param_flat = torch.zeros(chunk_len * self.dp, dtype=like.dtype, device=like.device)
        for (_, p), off in zip(named, offsets):
            param_flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
            p.data = param_flat[off:off + p.numel()].view_as(p)  # frees the old storage if nothing else holds it
        grad_flat = torch.zeros_like(param_flat)  # only now: the peak is two parameter sets, not three
        for (_, p), off in zip(named, offsets):
            view = grad_flat[off:off + p.numel()]
            if p.grad is not None:
                view.copy_(p.grad.reshape(-1))
            p.grad = view.view_as(p)
        return FlatGroup(list(plan.names), params, offsets, chunk_len, self.dp, param_flat, grad_flat, plan.late)

    @property
    def params(self) -> list[torch.Tensor]:
        return [p for g in self.groups for p in g.params]

    def owned_grad_views(self, names=None) -> list[torch.Tensor]:
        """Views of this rank's chunk of the gradients: the pieces of the named parameters (all when None)."""
        keep = None if names is None else set(names)
        return [g.grad_flat[a:b] for g in self.groups for i, a, b in g.segments(self.rank)
                if keep is None or g.names[i] in keep]

    def owned_grad_chunks(self) -> list[torch.Tensor]:
        return [g.chunk(g.grad_flat, self.rank) for g in self.groups]

    def numel(self) -> int:
        """Elements of the (padded) flat gradient vectors together."""
        return sum(g.grad_flat.numel() for g in self.groups)

    @torch.no_grad()
    def zero_grad(self) -> None:
        """Zero every gradient in place (the .grad views stay attached)."""
        for g in self.groups:
            g.grad_flat.zero_()


@torch.no_grad()
def flat_all_reduce_(tensors: list[torch.Tensor], group) -> None:
    """Sum `tensors` over `group` in place through ONE all-reduce of their concatenation (copied back after);
    for small sets of tensors that are not adjacent in memory. Nothing happens for a None group or no tensors."""
    if group is None or not tensors:
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
