"""The loop with per-sequence depths and truncated backprop: the ragged loop (what the model runs) and the masked
loop (the former reference, kept for comparison and for per-sequence k that is not end-aligned).

Both call lap(h, *rows) -> h', where `rows` are per-row tensors (dim 0 = batch, or None) sliced like h, or
RowGroups (the document structure of the rows under model.doc_mask) that take and slice themselves. The core
mixes positions only within a sequence and has no lap index, so each sequence gets exactly what it would get alone
at its own depth. Nothing is stored for laps without gradient, so memory does not grow with n.

ragged: rows sorted by depth (descending) and aligned at their end (see depth_plan); lap t runs only its active
  prefix, so the core passes executed (rows x laps) equal sum T_i.
masked: every row runs max(n) no-grad laps then max(k) grad laps; torch.where holds the rows that are done.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np
import torch

from megaloop.model.depth_plan import DepthPlan, RaggedPlan
from megaloop.model.transfer import to_device


@dataclass
class LoopResult:
    h: torch.Tensor  # h_T of every row (the caller's row order)
    h_prev: torch.Tensor  # the state before each row's last lap, detached
    laps: int  # laps run (executed steps)
    core_rows: int  # rows x laps passed through the core


class RowGroup(Protocol):
    """Per-row data that is not one tensor (megaloop.model.documents.Documents): it permutes and slices itself."""

    def take(self, order: np.ndarray) -> "RowGroup":
        """The rows in host order `order`."""

    def head(self, rows: int) -> "RowGroup":
        """The first `rows` rows (itself when that is all of them)."""


def _slice(rows, p: int):
    """The first p rows of each; the tensor itself when that is all of it (a view made under no_grad of a tensor
    that requires grad reports requires_grad without a grad_fn, which module hooks such as FlopCounterMode's
    tracker cannot attach to)."""
    return [None if r is None else r.head(p) if not torch.is_tensor(r) else r if p == r.shape[0] else r[:p]
            for r in rows]


def _take(row, perm: torch.Tensor, order: np.ndarray):
    """One row entry in plan order: a tensor gathered on its device, a RowGroup by the host order."""
    if row is None:
        return None
    return row.index_select(0, perm) if torch.is_tensor(row) else row.take(order)


def run_loop_ragged(lap: Callable, h0: torch.Tensor, rows: list, plan: RaggedPlan) -> LoopResult:
    """h0 and rows in the caller's order; permuted by plan.order on the way in and back on the way out (the order
    and its inverse are built on the host and moved to the device in one non-blocking copy per micro-batch)."""
    perm = inverse = None
    if not plan.is_identity:
        perm, inverse = to_device(np.stack([plan.order, np.argsort(plan.order)]), h0.device)
        h0 = h0.index_select(0, perm)
        rows = [_take(r, perm, plan.order) for r in rows]
    outer_grad = torch.is_grad_enabled()
    h, h_prev = h0, h0
    for t, p in enumerate(plan.prefix):
        h_prev = h
        with torch.set_grad_enabled(outer_grad and t >= plan.boundary):
            new = lap(h[:p], *_slice(rows, p))
        # a new tensor, not an in-place write, so autograd keeps the rows that have not started (h_0)
        h = new if p == h.shape[0] else torch.cat([new, h[p:]])
    h_prev = h_prev.detach()
    if inverse is not None:
        h, h_prev = h.index_select(0, inverse), h_prev.index_select(0, inverse)
    return LoopResult(h, h_prev, plan.laps, plan.core_rows)


def _masked_phase(lap, h, h_prev, rows, steps: np.ndarray, n_steps: int):
    """n_steps laps over every row; row i is updated while t < steps[i] (masks built on the host, moved once,
    without blocking)."""
    if n_steps == 0:
        return h, h_prev
    everyone = bool((steps == n_steps).all())
    active = to_device(np.arange(n_steps)[:, None] < steps[None, :], h.device).view(n_steps, -1, 1, 1)
    for t in range(n_steps):
        new = lap(h, *rows)
        if everyone:
            h_prev, h = h.detach(), new
            continue
        h_prev = torch.where(active[t], h.detach(), h_prev)
        h = torch.where(active[t], new, h)
    return h, h_prev


def run_loop_masked(lap: Callable, h0: torch.Tensor, rows: list, plan: DepthPlan) -> LoopResult:
    h, h_prev = h0, h0.detach()
    with torch.no_grad():
        h, h_prev = _masked_phase(lap, h, h_prev, rows, plan.nograd, plan.nograd_steps)
    h, h_prev = _masked_phase(lap, h, h_prev, rows, plan.grad, plan.grad_steps)
    laps = plan.nograd_steps + plan.grad_steps
    return LoopResult(h, h_prev.detach(), laps, laps * h0.shape[0])


def run_loop(lap: Callable, h0: torch.Tensor, rows: list, plan: DepthPlan) -> LoopResult:
    """The ragged loop when the gradient laps are end-aligned (always for an int or None backprop_depth and for
    the trainer's k_i = min(T_i, mu_bwd)); the masked loop for any other per-sequence k."""
    if plan.end_aligned:
        return run_loop_ragged(lap, h0, rows, RaggedPlan.make(plan))
    return run_loop_masked(lap, h0, rows, plan)


def loop_telemetry(result: LoopResult, plan: DepthPlan) -> dict:
    """state_norm and recurrent_residual: means over rows and positions of ||h_T|| and ||h_T - h_{T-1}|| (L2 over
    channels), 0-dim detached tensors on h's device (no host sync); executed_steps (laps run), useful_steps (sum T)
    and core_rows (rows x laps through the core) as python ints."""
    with torch.no_grad():
        hd = result.h.detach()
        hd = hd if hd.dtype in (torch.float32, torch.float64) else hd.float()
        return {
            "state_norm": hd.norm(dim=-1).mean(),
            "recurrent_residual": (hd - result.h_prev.to(hd.dtype)).norm(dim=-1).mean(),
            "executed_steps": result.laps,
            "useful_steps": int(plan.total.sum()),
            "core_rows": result.core_rows,
        }
