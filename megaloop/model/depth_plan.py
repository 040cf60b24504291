"""The loop's schedule for one micro-batch, computed on the host from host integers (never from device tensors).

Each sequence i has T_i = n_i + k_i laps: n_i without gradient, then k_i with. The ragged schedule sorts the rows by
T (descending, stable) and aligns them at their end: at lap t of Tmax the active rows (T_i >= Tmax - t) are a prefix
of the sorted batch. When k_i = min(T_i, K) with K = max k (the trainer's truncated backprop), every gradient lap
lies in the last K laps, so the no-grad/grad boundary is one lap for the whole micro-batch.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np
import torch


def host_depths(value, batch: int, name: str) -> np.ndarray:
    """int64 [batch] from an int, a sequence of ints, a numpy integer array or a CPU integer tensor (one value or
    one per sequence). A device tensor is refused: reading it would wait for the device."""
    if torch.is_tensor(value):
        if value.device.type != "cpu":
            raise TypeError(f"{name} is on {value.device}; pass host depths (int, list, numpy array or CPU tensor) "
                            "so that planning the loop never waits for the device")
        if value.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be an integer tensor of per-sequence values, got dtype {value.dtype}")
        value = value.numpy()
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return np.full(batch, operator.index(value), dtype=np.int64)
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu" or arr.size not in (1, batch):
        raise TypeError(f"{name} must be an int or {batch} integer per-sequence values, got {value!r}")
    return np.broadcast_to(arr.astype(np.int64).reshape(-1), (batch,)).copy()


@dataclass(frozen=True)
class DepthPlan:
    """Per-sequence total depths T_i and gradient laps k_i (host int64 arrays [B])."""

    total: np.ndarray
    grad: np.ndarray

    @staticmethod
    def make(depth, backprop_depth, batch: int) -> "DepthPlan":
        total = host_depths(depth, batch, "depth")
        if (total < 1).any():
            raise ValueError(f"every loop depth must be >= 1, got {total.tolist()}")
        if backprop_depth is None:
            return DepthPlan(total, total.copy())
        k = host_depths(backprop_depth, batch, "backprop_depth")
        if (k < 0).any():
            raise ValueError(f"backprop_depth must be >= 0, got {k.tolist()}")
        return DepthPlan(total, np.minimum(total, k))

    @property
    def nograd(self) -> np.ndarray:
        return self.total - self.grad

    @property
    def nograd_steps(self) -> int:
        return int(self.nograd.max())

    @property
    def grad_steps(self) -> int:
        return int(self.grad.max())

    @property
    def end_aligned(self) -> bool:
        """True when k_i = min(T_i, K), K = max k: the gradient laps of every row are the last K laps."""
        return bool((self.grad == np.minimum(self.total, self.grad_steps)).all())


@dataclass(frozen=True)
class RaggedPlan:
    """order: the rows sorted by depth (descending, stable); prefix[t]: the active rows at lap t; boundary: the
    first lap with gradient (laps before it run without)."""

    order: np.ndarray
    prefix: tuple[int, ...]
    boundary: int

    @staticmethod
    def make(plan: DepthPlan) -> "RaggedPlan":
        if not plan.end_aligned:
            raise ValueError("the ragged loop needs k_i = min(T_i, max k); use the masked loop for other k")
        order = np.argsort(-plan.total, kind="stable")
        t_max = int(plan.total.max())
        sorted_total = plan.total[order]
        # rows with T_i >= t_max - t are active at lap t; sorted descending, they are the first `count` rows
        prefix = tuple(int((sorted_total >= t_max - t).sum()) for t in range(t_max))
        return RaggedPlan(order, prefix, t_max - plan.grad_steps)

    @property
    def laps(self) -> int:
        return len(self.prefix)

    @property
    def core_rows(self) -> int:
        return sum(self.prefix)

    @property
    def is_identity(self) -> bool:
        return bool((self.order == np.arange(self.order.size)).all())
