"""The global gradient norm of a model split over tensor- and pipeline-parallel ranks and replicated over
data-parallel ones, with every parameter counted exactly once.

After the data-parallel reduction every dp rank holds the same gradients, so dp does not enter the sum. A parameter
split over tp contributes its local shard on every tp rank; a parameter replicated over tp (norms, the injection,
C) contributes only on tp rank 0. The local sums are then added over the tp group and over the pp group (each stage
holds different parameters).
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch

from pipeline.collectives import all_reduce_


def sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """Sum of squares of every element: per-tensor norms in (at least) fp32, squared and summed in float64."""
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    norms = torch._foreach_norm([g if g.dtype in (torch.float32, torch.float64) else g.float() for g in grads])
    return torch.stack([n.to(dtype=torch.float64) for n in norms]).square().sum()


def owned_grads(named_params: Iterable[tuple[str, torch.Tensor]], split_names, tp_rank: int) -> list[torch.Tensor]:
    """The gradients this rank counts: every split parameter's shard, replicated ones only on tp rank 0."""
    split = set(split_names)
    return [p.grad for name, p in named_params
            if p.grad is not None and (name in split or tp_rank == 0)]


def global_grad_norm_sq(named_params, split_names, layout) -> torch.Tensor:
    """The squared global gradient norm (float64 scalar, equal on every rank)."""
    tp_rank = layout.tp_rank if layout.tp > 1 else 0
    local = sum_of_squares(owned_grads(named_params, split_names, tp_rank))
    local = local.to(layout.device)
    all_reduce_(local, layout.tp_group)
    all_reduce_(local, layout.pp_group)
    return local.cpu()


def make_norm_sq_reduce(model: torch.nn.Module, split_names, layout) -> Callable[[torch.Tensor], torch.Tensor]:
    """A `norm_sq_reduce` for an optimizer's clip: it ignores the local sum it is given (which counts replicated
    parameters on every tp rank) and returns the global sum computed from the model's gradients as above."""
    split = frozenset(split_names)

    def reduce(_local_sum: torch.Tensor) -> torch.Tensor:
        return global_grad_norm_sq(list(model.named_parameters()), split, layout)

    return reduce
