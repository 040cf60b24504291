"""What each train.precision means for parameters, activations and Muon's orthogonalisation.

auto: bf16 where the device computes bf16 natively (a GPU from Ampere on; a CPU with AVX512-BF16 or AMX), fp32
      otherwise (megaloop/train/hardware.py): resolved once per run by `resolve_precision`, before anything is built.
bf16: fp32 parameters and optimizer state, bf16 autocast for the matmuls, Polar Express in bf16 (the reference).
fp32: everything in fp32 except Polar Express, which stays in bf16 as in the reference.
Under bf16 and fp32, Muon's Polar Express runs in fp32 instead where the device has no native bf16: emulated, its
bf16 matmuls would dominate a small model's step (the README's figures table has the measurement).
fp64: everything in float64, Polar Express included: a verification precision (slow; CPU checks of exactness such
      as parallel layouts against one process, where fp32 rounding would otherwise be amplified by AdamW's tiny eps
      and by Muon's cautious weight decay).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

PRECISIONS = ("bf16", "fp32", "fp64")
CHOICES = ("auto", *PRECISIONS)


@dataclass(frozen=True)
class PrecisionChoice:
    """The precision a run computes in (never "auto"), what the config asked for, and why."""

    precision: str
    requested: str
    why: str
    native_bf16: bool = True  # the device computes bf16 natively (Muon's Polar Express runs in bf16 then)
    warning: str | None = None  # a one-line warning to print (bf16 asked for where it is emulated)

    def header(self) -> str:
        orth = "" if self.precision == "fp64" else \
            f", Muon's Polar Express in {'bf16' if self.native_bf16 else 'fp32'}"
        return f"precision {self.precision} ({self.why}{orth})"


def resolve_precision(requested: str, device: torch.device, slowdown=None) -> PrecisionChoice:
    """What `requested` means on `device`. `slowdown()`, called only for an explicit bf16 on a CPU without native
    bf16, returns the measured fp32/bf16 matmul speed ratio for the warning (None: not measured)."""
    from megaloop.train.hardware import bf16_support

    if requested not in CHOICES:
        raise ValueError(f"train.precision={requested!r}: use one of {CHOICES}")
    support = bf16_support(device)
    if requested == "auto":
        if support.native:
            return PrecisionChoice("bf16", "auto", f"auto: {support.why}")
        return PrecisionChoice("fp32", "auto", f"auto: {support.why}, so bf16 would be emulated, many times slower",
                               native_bf16=False)
    if requested != "bf16" or support.native or device.type == "cuda":
        return PrecisionChoice(requested, requested, "set in the config", native_bf16=support.native)
    ratio = slowdown() if slowdown is not None else None
    slower = f"measured {ratio:.0f}x slower than fp32 here" if ratio else "emulated, many times slower than fp32"
    return PrecisionChoice("bf16", "bf16", "set in the config", native_bf16=False, warning=(
        f"train.precision=bf16, but {support.why}: its bf16 matmuls are {slower}; train.precision=auto (or fp32) "
        "runs in fp32 here"))


def _concrete(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {PRECISIONS}: resolve train.precision=auto for the "
                         "device first (resolve_precision; train() does it)")
    return precision


def param_dtype(precision: str) -> torch.dtype:
    """The dtype of parameters, gradients and optimizer state."""
    _concrete(precision)
    return torch.float64 if precision == "fp64" else torch.float32


def orth_dtype(precision: str, native_bf16: bool = True) -> torch.dtype:
    """The dtype of Muon's Polar Express iteration: bf16 as in the reference where bf16 is native, else fp32."""
    if _concrete(precision) == "fp64":
        return torch.float64
    return torch.bfloat16 if native_bf16 else torch.float32


def autocast_for(precision: str, device: torch.device):
    """The forward's autocast context: bf16 autocast for bf16, nothing otherwise."""
    _concrete(precision)
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def apply_optimizer_precision(optimizer, precision: str, native_bf16: bool = True):
    """Set Muon's orthogonalisation dtype on a combined optimizer (before a runtime distributes it)."""
    if getattr(optimizer, "muon", None) is not None:
        optimizer.muon.orth_dtype = orth_dtype(precision, native_bf16)
    return optimizer
