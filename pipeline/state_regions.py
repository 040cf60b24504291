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
