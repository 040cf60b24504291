"""Where a rank's tensors sit inside layout-free global arrays (for checkpoints that change layout on load).

Checkpoints store every parameter and optimizer state as one array of the GLOBAL shape, named by parameter name.
A rank holds either the whole array (replicated tensors, a matrix whose Muon state it owns) or its tensor-parallel
shard of it. A shard of a parameter split with :class:`ShardSpec` (`parts` blocks along `dim`, each cut into `tp`
pieces, rank r holding piece r of every block) is `parts` rectangular regions of the global array:

    block p, rank r:  offset along dim = p * size / parts + r * size / (parts * tp),  length size / (parts * tp)

State entries exchanged with the optimizers are plain tuples ``(array name, parameter name, tensor, sharded)``:
`sharded` True means the tensor has this rank's shard shape of the parameter (placed by its ShardSpec), False that
it is the whole array.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.tensor_parallel import ShardSpec


@dataclass(frozen=True)
class Region:
    """One rectangular region of a global array and the part of the local tensor that fills it."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    local: torch.Tensor


def shard_regions(local: torch.Tensor, spec: ShardSpec | None, tp_rank: int) -> list[Region]:
    """The regions of the global array that this rank's shard `local` covers (one per block of the spec)."""
    if spec is None or spec.tp == 1:
        return [Region(tuple(local.shape), (0,) * local.dim(), local)]
    shape = list(local.shape)
    shape[spec.dim] *= spec.tp
    piece = local.shape[spec.dim] // spec.parts
    regions = []
    for part, block in enumerate(local.split(piece, dim=spec.dim)):
        offsets = [0] * local.dim()
        offsets[spec.dim] = part * piece * spec.tp + tp_rank * piece
        regions.append(Region(tuple(shape), tuple(offsets), block))
    return regions


def global_shape(local_shape, spec: ShardSpec | None) -> tuple[int, ...]:
    shape = list(local_shape)
    if spec is not None:
        shape[spec.dim] *= spec.tp
    return tuple(shape)


def read_shard(read_region, local_shape, spec: ShardSpec | None, tp_rank: int) -> torch.Tensor:
    """This rank's shard, assembled from `read_region(offsets, shape)` calls on the global array (the inverse of
    :func:`shard_regions`)."""
    like = torch.empty(local_shape, device="meta")
    parts = [read_region(r.offsets, tuple(r.local.shape)) for r in shard_regions(like, spec, tp_rank)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=spec.dim)


# ---- row blocks: the ZeRO-1 moment owners' unit of writing and reading ----------------------------------------
BLOCK_BYTES = 4 << 20  # target bytes of one moment chunk written by its owner (a few MiB: few files, small ends)


@dataclass(frozen=True)
class RowBlock:
    """Marks a state entry whose tensor holds rows [start, stop) along dim 0 of this rank's shard of shape
    `shard_shape` (a 0-d shard is one row), as written by the data-parallel rank that updates them."""

    start: int
    stop: int
    shard_shape: tuple[int, ...]


def shard_rows(local_shape) -> tuple[int, int]:
    """(rows, elements per row) of a shard seen as rows along dim 0 (a 0-d tensor: one row of one element)."""
    local_shape = tuple(local_shape)
    if not local_shape:
        return 1, 1
    inner = 1
    for s in local_shape[1:]:
        inner *= s
    return local_shape[0], inner


def block_rows(local_shape, spec: ShardSpec | None, itemsize: int, target_bytes: int | None = None) -> int:
    """Rows per block of a shard: the largest divisor of the rows of one tensor-parallel region (rows / parts when
    the shard is cut along dim 0, else all rows) whose block stays within `target_bytes` (at least one row). Blocks
    then tile every region, so the blocks of all ranks form one regular chunk grid of the global array."""
    rows, inner = shard_rows(local_shape)
    region = rows // spec.parts if spec is not None and spec.tp > 1 and spec.dim == 0 else rows
    if region <= 1:
        return max(region, 1)
    cap = max(1, (target_bytes or BLOCK_BYTES) // max(1, inner * itemsize))
    best, d = 1, 1
    while d * d <= region:
        if region % d == 0:
            best = max(best, *(x for x in (d, region // d) if x <= cap), 1)
        d += 1
    return best


def row_regions(local_shape, spec: ShardSpec | None, tp_rank: int, start: int, stop: int) -> list[tuple]:
    """(global offsets, shape, index into rows [start, stop) of the shard) of every rectangle of the global array
    that those rows of this rank's shard cover (one per tensor-parallel block they touch)."""
    shape = tuple(local_shape)
    if not shape:
        return [((), (), ())]
    n = len(shape)
    if spec is None or spec.tp == 1:
        return [((start,) + (0,) * (n - 1), (stop - start,) + shape[1:], (slice(0, stop - start),))]
    piece = shape[spec.dim] // spec.parts
    out = []
    for part in range(spec.parts):
        offsets, size, index = [0] * n, list(shape), [slice(None)] * n
        if spec.dim == 0:
            lo, hi = max(start, part * piece), min(stop, (part + 1) * piece)
            if lo >= hi:
                continue
            offsets[0] = part * piece * spec.tp + tp_rank * piece + lo - part * piece
            size[0], index[0] = hi - lo, slice(lo - start, hi - start)
        else:
            offsets[0], size[0], index[0] = start, stop - start, slice(0, stop - start)
            offsets[spec.dim] = part * piece * spec.tp + tp_rank * piece
            size[spec.dim], index[spec.dim] = piece, slice(part * piece, (part + 1) * piece)
        out.append((tuple(offsets), tuple(size), tuple(index)))
    return out


def read_rows(read_region, local_shape, spec: ShardSpec | None, tp_rank: int, start: int, stop: int) -> torch.Tensor:
    """Rows [start, stop) of this rank's shard, from `read_region(offsets, shape)` calls that touch only them."""
    regions = row_regions(local_shape, spec, tp_rank, start, stop)
    if not tuple(local_shape):
        return read_region((), ())
    parts = [(index, read_region(offsets, size)) for offsets, size, index in regions]
    out = torch.empty((stop - start,) + tuple(local_shape)[1:], dtype=parts[0][1].dtype)
    for index, value in parts:
        out[index] = value
    return out
