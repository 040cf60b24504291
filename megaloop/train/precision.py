"""What each train.precision means for parameters, activations and Muon's orthogonalisation.

bf16: fp32 parameters and optimizer state, bf16 autocast for the matmuls, Polar Express in bf16 (the reference).
fp32: everything in fp32 except Polar Express, which stays in bf16 as in the reference.
fp64: everything in float64, Polar Express included: a verification precision (slow; CPU checks of exactness such
      as parallel layouts against one process, where fp32 rounding would otherwise be amplified by AdamW's tiny eps
      and by Muon's cautious weight decay).
"""
from __future__ import annotations

import contextlib

import torch

PRECISIONS = ("bf16", "fp32", "fp64")


def param_dtype(precision: str) -> torch.dtype:
    """The dtype of parameters, gradients and optimizer state."""
    return torch.float64 if precision == "fp64" else torch.float32


def orth_dtype(precision: str) -> torch.dtype:
    """The dtype of Muon's Polar Express iteration."""
    return torch.float64 if precision == "fp64" else torch.bfloat16


def autocast_for(precision: str, device: torch.device):
    """The forward's autocast context: bf16 autocast for bf16, nothing otherwise."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def apply_optimizer_precision(optimizer, precision: str):
    """Set Muon's orthogonalisation dtype on a combined optimizer (before a runtime distributes it)."""
    if getattr(optimizer, "muon", None) is not None:
        optimizer.muon.orth_dtype = orth_dtype(precision)
    return optimizer
