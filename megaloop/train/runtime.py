"""What the training loop needs from the parallel layout, and its single-process form.

The trainer talks to one object with these methods; pipeline/ provides the multi-process one (tensor, data and
pipeline groups), so the loop itself has no parallel code.
"""
from __future__ import annotations

from typing import Callable

import torch


class SingleProcessRuntime:
    """World of one: every reduction is the identity."""

    rank = 0
    world_size = 1
    dp_rank = 0
    dp_size = 1
    is_main = True

    def __init__(self, device: torch.device):
        self.device = device

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def sum_over_dp(self, value: float) -> float:
        return value

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        return None

    def norm_sq_reduce(self) -> Callable | None:
        return None

    def mean_over_dp(self, value: float) -> float:
        return value

    def barrier(self) -> None:
        return None

    def close(self) -> None:
        return None
