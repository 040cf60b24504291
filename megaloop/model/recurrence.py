"""The loop with per-sequence depths and truncated backprop, with the reference semantics.

Each sequence i has T_i = n_i + k_i steps: n_i without gradient, then k_i with. The batch runs a no-grad phase of
max(n) steps (sequence i updated only while t < n_i, holding its state otherwise) and then a grad phase of max(k)
steps (updated while t < k_i). Nothing is stored for the no-grad phase, so memory does not grow with n. Because the
core mixes positions only within a sequence, each sequence gets exactly what it would get alone at its own depth.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass
class DepthPlan:
    total: torch.Tensor  # T_i, LongTensor [B]
    grad: torch.Tensor  # k_i
    nograd: torch.Tensor  # n_i = T_i - k_i

    @staticmethod
    def make(depth, backprop_depth, batch: int, device) -> "DepthPlan":
        total = _per_sequence(depth, batch, "depth")
        if bool((total < 1).any()):
            raise ValueError(f"every loop depth must be >= 1, got {total.tolist()}")
        if backprop_depth is None:
            grad = total.clone()
        else:
            k = _per_sequence(backprop_depth, batch, "backprop_depth")
            if bool((k < 0).any()):
                raise ValueError(f"backprop_depth must be >= 0, got {k.tolist()}")
            grad = torch.minimum(total, k)
        return DepthPlan(total.to(device), grad.to(device), (total - grad).to(device))

    @property
    def nograd_steps(self) -> int:
        return int(self.nograd.max())

    @property
    def grad_steps(self) -> int:
        return int(self.grad.max())


def _per_sequence(value, batch: int, name: str) -> torch.Tensor:
    if isinstance(value, int):
        return torch.full((batch,), value, dtype=torch.long)
    if torch.is_tensor(value) and value.dtype in (torch.int32, torch.int64) and value.numel() in (1, batch):
        return value.detach().to("cpu", torch.long).reshape(-1).expand(batch).clone()
    raise TypeError(f"{name} must be an int or an integer tensor of {batch} per-sequence values, got {value!r}")


def _phase(step_fn, h, h_prev, e, ctx, steps: torch.Tensor, n_steps: int):
    """Run n_steps loop steps; sequence i is updated while t < steps[i]. Returns (h, h_prev)."""
    everyone = bool((steps == n_steps).all())
    for t in range(n_steps):
        new = step_fn(h, e, ctx)
        if everyone:
            h_prev, h = h.detach(), new
            continue
        active = (t < steps).view(-1, 1, 1)
        h_prev = torch.where(active, h.detach(), h_prev)
        h = torch.where(active, new, h)
    return h, h_prev


def run_loop(step_fn: Callable, e: torch.Tensor, h0: torch.Tensor, plan: DepthPlan, ctx) -> tuple[torch.Tensor, dict]:
    """h_T for every sequence, plus telemetry: ||h_T||, ||h_T - h_{T-1}|| (means over positions of the L2 norm
    over channels), executed steps (max n + max k) and useful steps (sum of T_i)."""
    h, h_prev = h0, h0.detach()
    with torch.no_grad():
        h, h_prev = _phase(step_fn, h, h_prev, e, ctx, plan.nograd, plan.nograd_steps)
    h, h_prev = _phase(step_fn, h, h_prev, e, ctx, plan.grad, plan.grad_steps)
    with torch.no_grad():
        hd = h.detach().float()
        telemetry = {
            "state_norm": float(hd.norm(dim=-1).mean()),
            "recurrent_residual": float((hd - h_prev.float()).norm(dim=-1).mean()),
            "executed_steps": plan.nograd_steps + plan.grad_steps,
            "useful_steps": int(plan.total.sum()),
        }
    return h, telemetry
