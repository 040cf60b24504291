"""Who writes what: the plan every rank computes from the gathered declarations.

Each rank declares its regions as ``(name, global_shape, dtype, offsets, shape)``. From the list of every rank's
declarations (gathered on rank 0, which hands each rank its :meth:`SavePlan.part_of`) :func:`make_plan` derives,
deterministically:

* per array, its distinct regions; they must tile the array as a regular grid of equal blocks, and that block is
  the zarr chunk shape, so every writer owns whole chunks (zarr loses concurrent updates inside one chunk);
* per region, exactly one writing rank: replicas (the same region declared by several ranks, e.g. data-parallel
  copies) are written once, by the least-loaded holder, regions taken largest first (ties by rank).
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from .pieces import ITEMSIZE, dtype_name

Declaration = tuple  # (name, global_shape, dtype name, offsets, shape), plain tuples so any gather can carry them


@dataclass
class ArrayPlan:
    """One global array: shape, dtype name, chunk shape, and the rank writing each chunk (keyed by offsets)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[int, ...]
    writers: dict[tuple[int, ...], int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]

    @property
    def chunk_nbytes(self) -> int:
        """Bytes of one chunk file (0 for an empty array, which has no chunk files)."""
        return math.prod(self.chunks) * ITEMSIZE[self.dtype] if self.nbytes else 0


@dataclass
class SavePlan:
    arrays: dict[str, ArrayPlan]
    world_size: int

    def regions_of(self, rank: int) -> list[tuple[str, tuple[int, ...]]]:
        """(array name, offsets) of every chunk `rank` writes, in a stable order."""
        return [(a.name, off) for a in self.arrays.values() for off, r in sorted(a.writers.items()) if r == rank]

    def part_of(self, rank: int) -> "SavePlan":
        """The plan restricted to the chunks `rank` writes (all another rank needs to write its part)."""
        arrays = {}
        for name, a in self.arrays.items():
            mine = {off: r for off, r in a.writers.items() if r == rank}
            if mine:
                arrays[name] = ArrayPlan(a.name, a.shape, a.dtype, a.chunks, mine)
        return SavePlan(arrays, self.world_size)

    def bytes_of(self, rank: int) -> int:
        return sum(a.chunk_nbytes for a in self.arrays.values() for r in a.writers.values() if r == rank)


def declare(pieces) -> list[Declaration]:
    return [(p.name, tuple(int(x) for x in p.global_shape), dtype_name(p.tensor.dtype),
             tuple(int(x) for x in p.offsets), tuple(p.tensor.shape)) for p in pieces]


def make_plan(per_rank: list[list[Declaration]]) -> SavePlan:
    """The save plan for every rank's declarations (rank order); ValueError naming the array when they do not fit."""
    by_name: dict[str, list] = defaultdict(list)
    for rank, decls in enumerate(per_rank):
        for name, gshape, dtype, offsets, shape in decls:
            by_name[name].append((rank, tuple(gshape), dtype, tuple(offsets), tuple(shape)))
    _check_no_array_inside_array(by_name)
    arrays, holders = {}, {}
    for name in sorted(by_name):
        shape, dtype, regions = _agree(name, by_name[name])
        arrays[name] = ArrayPlan(name, shape, dtype, _grid_chunks(name, shape, regions))
        for offsets, (_, ranks) in regions.items():
            holders[(name, offsets)] = ranks
    _assign_writers(arrays, holders, len(per_rank))
    return SavePlan(arrays, len(per_rank))


def _check_no_array_inside_array(by_name) -> None:
    for name in by_name:
        parts = name.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in by_name:
                raise ValueError(f"array {name!r} lies inside array {'/'.join(parts[:i])!r}; a path is either a "
                                 "group or an array: rename one of them")


def _agree(name, entries):
    """Global shape and dtype every rank agrees on, and {offsets: (shape, [ranks])} of the distinct regions."""
    shapes = {e[1] for e in entries}
    dtypes = {e[2] for e in entries}
    if len(shapes) > 1 or len(dtypes) > 1:
        seen = sorted({(r, g, d) for r, g, d, _, _ in entries})
        raise ValueError(f"array {name!r}: ranks disagree on its global shape or dtype {seen}; "
                         "every rank must declare the same global shape and dtype for one array")
    regions: dict[tuple, tuple] = {}
    for rank, _, _, offsets, shape in entries:
        known = regions.setdefault(offsets, (shape, []))
        if known[0] != shape:
            raise ValueError(f"array {name!r}: regions at offsets {offsets} have shapes {known[0]} and {shape}; "
                             "regions must tile the array as a regular grid of equal blocks")
        if rank in known[1]:
            raise ValueError(f"array {name!r}: rank {rank} declares the region at offsets {offsets} twice; "
                             "declare each region once per rank")
        known[1].append(rank)
    return shapes.pop(), dtypes.pop(), regions


def _grid_chunks(name, shape, regions) -> tuple[int, ...]:
    """The block shape the regions tile `shape` with (the chunk shape); ValueError if they are not a regular grid."""
    listing = sorted((off, s) for off, (s, _) in regions.items())
    if math.prod(shape) == 0:
        if listing != [((0,) * len(shape), shape)]:
            _not_a_grid(name, shape, listing, "an empty array is one region covering all of it")
        return tuple(max(1, s) for s in shape)
    blocks = {s for _, s in listing}
    if len(blocks) != 1:
        _not_a_grid(name, shape, listing, f"regions have different shapes {sorted(blocks)}")
    block = blocks.pop()
    if any(b == 0 or g % b for g, b in zip(shape, block)):
        _not_a_grid(name, shape, listing, f"block {block} does not divide the shape {shape}")
    if any(o % b for off, _ in listing for o, b in zip(off, block)):
        _not_a_grid(name, shape, listing, f"some offsets are not multiples of the block {block}")
    need = math.prod(g // b for g, b in zip(shape, block))
    if len(listing) != need:
        _not_a_grid(name, shape, listing, f"{len(listing)} regions of block {block} but the grid has {need}")
    return block


def _not_a_grid(name, shape, listing, why):
    shown = ", ".join(f"{off}+{s}" for off, s in listing[:8]) + (" ..." if len(listing) > 8 else "")
    raise ValueError(f"array {name!r} of shape {shape}: the declared regions do not tile it ({why}); regions "
                     f"(offsets+shape): {shown}; split each array into equal blocks at multiples of the block shape "
                     "that cover it exactly once (replicas may repeat a block)")


def _assign_writers(arrays, holders, world_size) -> None:
    """Each region to one of its holders: largest regions first, each to the least-loaded holder (ties by rank)."""
    load = [0] * world_size
    items = sorted(holders.items(), key=lambda kv: (-arrays[kv[0][0]].chunk_nbytes, kv[0]))
    for (name, offsets), ranks in items:
        plan = arrays[name]
        rank = min(ranks, key=lambda r: (load[r], r))
        load[rank] += plan.chunk_nbytes
        plan.writers[offsets] = rank
