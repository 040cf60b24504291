"""The global gradient norm of a model split over tensor- and pipeline-parallel ranks and over the data-parallel
chunks of a gradient buffer, with every element counted exactly once.

After the data-parallel reduction a rank holds the summed gradient of its own chunk of the buffer (ZeRO-1), or of
the whole buffer (one chunk: ZeRO stage 0 or dp 1). A parameter split over tp contributes its local shard's pieces
in that chunk on every tp rank; a parameter replicated over tp (norms, the injection, C) only on tp rank 0. The
local sum of squares is then added over the data-parallel group the chunks are spread over (one scalar all-reduce),
then over the tp group and over the pp group (each stage holds different parameters).
"""
from __future__ import annotations

import torch

from pipeline.collectives import all_reduce_


def counted_grad_views(buffer, split_names, tp: int, tp_rank: int, exclude=frozenset()) -> list[torch.Tensor]:
    """The views of this rank's chunk of `buffer` that count towards the norm: pieces of split parameters, and of
    replicated ones only on tp rank 0 (everything without tensor parallelism); never those named in `exclude`
    (under pipeline parallelism the last stage's copy of the tied embedding: the first stage counts it)."""
    names = None if tp == 1 or tp_rank == 0 else set(split_names)
    if exclude:
        names = ({n for g in buffer.groups for n in g.names} if names is None else names) - set(exclude)
    return buffer.owned_grad_views(names)


def reduce_norm_sq(local: torch.Tensor, layout, chunk_group) -> torch.Tensor:
    """The global squared norm (float64 scalar on the CPU, equal on every rank) from this rank's share: summed over
    `chunk_group` (the data-parallel group when the buffer is chunked, else None), tp and pp."""
    total = local.to(device=layout.comm_device, dtype=torch.float64)
    for group in (chunk_group, layout.tp_group, layout.pp_group):
        all_reduce_(total, group)
    return total.cpu()
