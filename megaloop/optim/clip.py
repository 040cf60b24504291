"""Global gradient-norm measurement and clipping, ready for sharded gradients.

The norm is built from a local sum of squares that a distributed caller can reduce (``norm_sq_reduce``, e.g. an
all-reduce over the ranks that hold disjoint shards) before the square root, so every rank sees the same global
norm and takes the same skip/clip decision.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
from torch import Tensor

CLIP_EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_: coefficient max_norm / (norm + 1e-6)


def grad_norm_sq(grads: list[Tensor]) -> Tensor:
    """Sum of squares of every element of ``grads``: a float64 scalar on the first gradient's device.

    Per-tensor norms are taken in (at least) fp32, then squared and summed in float64 so that a large but finite
    norm does not overflow into a spurious skip.
    """
    if not grads:
        return torch.zeros((), dtype=torch.float64)
    device = grads[0].device
    norms = torch._foreach_norm([g if g.dtype in (torch.float32, torch.float64) else g.float() for g in grads])
    return torch.stack([n.to(device=device, dtype=torch.float64) for n in norms]).square().sum()


@torch.no_grad()
def clip_grads(
    params: Iterable[Tensor],
    max_norm: float,
    norm_sq_reduce: Callable[[Tensor], Tensor | None] | None = None,
) -> float:
    """Return the global gradient norm before clipping, and scale every gradient by
    min(1, max_norm / (norm + 1e-6)) when that is below 1.

    ``params`` with ``grad`` None are ignored. ``max_norm <= 0`` measures without clipping. ``norm_sq_reduce`` is
    called on the local sum of squares (a 0-dim float64 tensor) and returns the global one (or reduces it in place
    and returns None). A non-finite norm leaves the gradients untouched (the caller skips the step).
    """
    grads = [p.grad for p in params if p.grad is not None]
    return clip_grad_tensors(grads, grads, max_norm, norm_sq_reduce)


@torch.no_grad()
def clip_grad_tensors(
    counted: list[Tensor],
    scaled: list[Tensor],
    max_norm: float,
    norm_sq_reduce: Callable[[Tensor], Tensor | None] | None = None,
) -> float:
    """:func:`clip_grads` on gradient tensors: the norm from the squares of ``counted`` (reduced by
    ``norm_sq_reduce``), the clip applied to ``scaled``. A sharded optimizer counts each element once over the
    ranks (its own chunk, replicated pieces on one rank) but scales everything it updates."""
    norm_sq = grad_norm_sq(counted)
    if norm_sq_reduce is not None:
        reduced = norm_sq_reduce(norm_sq)
        norm_sq = norm_sq if reduced is None else reduced
    norm_sq_value = float(norm_sq)
    norm = math.sqrt(norm_sq_value) if math.isfinite(norm_sq_value) else norm_sq_value
    if max_norm > 0 and math.isfinite(norm):
        coef = max_norm / (norm + CLIP_EPS)
        if coef < 1.0 and scaled:
            torch._foreach_mul_(scaled, coef)
    return norm
