"""How the model's blocks are executed: activation checkpointing and torch.compile (set by the trainer).

activation checkpointing: "none" stores every activation of the gradient laps; "block" recomputes each core block
in backward; "lap" recomputes a whole gradient lap (injection + every core block) from its input. Laps without
gradient store nothing in any mode. Non-reentrant torch.utils.checkpoint, only while gradients are recorded.
compile: each prelude/core/coda block is compiled once (nn.Module.compile, state_dict names unchanged) with dynamic
shapes, so the loop's varying active prefix (the batch dimension) does not recompile per size.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

CHECKPOINT_MODES = ("none", "block", "lap")


def check_checkpoint_mode(mode: str) -> str:
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"activation checkpointing {mode!r} is not one of {', '.join(CHECKPOINT_MODES)} "
                         "(train.activation_checkpointing)")
    return mode


def maybe_checkpoint(enabled: bool, fn: Callable, *args, recompute: Callable | None = None):
    """fn(*args), recomputed in backward when `enabled` and gradients are being recorded; `recompute(fn, *args)`
    replaces torch's non-reentrant checkpoint when given (an FP8 backend that must restore its state, e.g. TE's)."""
    if enabled and torch.is_grad_enabled():
        if recompute is not None:
            return recompute(fn, *args)
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def compile_blocks(blocks: Iterable[nn.Module], backend: str = "inductor") -> None:
    """Compile each block in place, once; dynamic shapes so that prefix sizes share one graph."""
    for block in blocks:
        if getattr(block, "_compiled_call_impl", None) is None:
            block.compile(backend=backend, dynamic=True)
