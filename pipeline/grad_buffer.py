"""Persistent flat parameter and gradient buffers, laid out so that each data-parallel rank owns one chunk.

Per dtype, every parameter lives at a fixed offset of one flat parameter vector and its .grad is the view at the
same offset of one flat gradient vector (set once: backward accumulates into it in place, and zeroing is in place).
The flat vectors have dp equal chunks of `chunk_len` elements; data-parallel rank r owns chunk r:

    chunk r = [the rest of a cuttable parameter begun in chunk r-1][the whole parameters pinned to r][cuttable ones]

Pinned parameters (Muon matrices, whose owner is decided by the distributed Muon) lie whole inside their owner's
chunk; cuttable ones (AdamW's, elementwise) fill the remaining room in order and may run across a chunk boundary,
which evens the chunk sizes out. Padding (zeros) is left only where nothing fits, at most a few elements with the
reference models. With dp = 1 there is one chunk holding everything (no sharding).

Because the chunks are contiguous and equal, a reduce-scatter of the gradient vector hands every rank the summed
gradient of exactly what it updates, and one all-gather of the parameter vector's chunks brings every rank the
updated parameters.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

ALIGN = 16  # chunk lengths are multiples of this many elements (aligned collective buffers)


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


@dataclass
class FlatGroup:
    """The parameters of one dtype: their names, offsets, and the flat parameter and gradient vectors."""

    names: list[str]
    params: list[torch.Tensor]
    offsets: list[int]
    chunk_len: int
    dp: int
    param_flat: torch.Tensor
    grad_flat: torch.Tensor

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
    """Flat buffers for `named_params` (see the module docstring): one FlatGroup per dtype, chunked over `dp`
    with this process owning chunk `rank`. `owners` maps a parameter name to the chunk that must hold it whole
    (absent: cuttable). The parameters' .data and .grad become views into the buffers (values are kept); the
    gradient vector is allocated after the parameters moved, so laying out holds at most the old and the flat
    parameters at once (plus any gradients that exist)."""

    def __init__(self, named_params: list[tuple[str, torch.Tensor]], dp: int = 1, rank: int = 0,
                 owners: dict[str, int] | None = None):
        owners = owners or {}
        self.dp, self.rank = dp, rank
        named = [(n, p) for n, p in named_params if p.requires_grad]
        self.groups = [self._make_group([(n, p) for n, p in named if p.dtype == dtype], owners)
                       for dtype in dict.fromkeys(p.dtype for _, p in named)]

    @torch.no_grad()
    def _make_group(self, named, owners) -> FlatGroup:
        items = [Item(p.numel(), owners.get(n)) for n, p in named]
        chunk_len, offsets = plan_chunks(items, self.dp)
        like = named[0][1]
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
        return FlatGroup([n for n, _ in named], [p for _, p in named], offsets, chunk_len, self.dp, param_flat,
                         grad_flat)

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
