"""Optimizers for megaloop: Muon (Polar Express + NorMuon + cautious weight decay) and AdamW groups, split by
parameter name, on the reference's trapezoid schedule, with global clipping and non-finite step skipping.

Names are loaded lazily, so ``from megaloop.optim.config import OptimConfig`` (used by the config tree) does not
import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "clip": ("clip_grads", "grad_norm_sq"),
    "combined": ("CombinedOptimizer", "StepRecord", "build_optimizer"),
    "config": ("OptimConfig",),
    "grouping": ("ParamGroups", "adamw_reason", "canonical_name", "split_param_groups"),
    "muon": (
        "Muon",
        "MuonHParams",
        "apply_muon_update",
        "init_muon_state",
        "muon_lr_scale",
        "muon_update",
        "normuon_rescale",
    ),
    "orthogonalize": ("POLAR_EXPRESS_COEFFS", "polar_express"),
    "schedule": ("ScheduledValues", "continued_values", "lr_multiplier", "muon_momentum", "muon_weight_decay",
                 "scheduled_values"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    """Import the submodule that defines ``name`` on first access."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'megaloop.optim' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
