"""Transformer Engine FP8 backend (train.fp8_backend=te; GPU only).

Each selected linear layer of a block is replaced by a `transformer_engine.pytorch.Linear` that holds the very same
`weight` Parameter under the same qualified name, so the block's parameter names are the native block's: the
checkpoints (written from named_parameters), resharding, the official converter and the exports are unchanged. TE
adds one non-parameter key per module to state_dict, `<layer>._extra_state` (its FP8 metadata):
:func:`te_to_native` drops those keys and :func:`native_to_te` supplies them from a TE model (both ways of the key
mapping); the layout-free checkpoint never holds them.

In the loop (one weight runs T times per step, some laps without autograd):
  - recipe: Float8CurrentScaling (a per-call scale, nothing carried between calls); DelayedScaling keeps one amax
    history per module and must not see a module twice in one step, so :func:`te_recipe` refuses it for any module
    called more than once per step (TE 2.x no longer checks this and would fail silently);
  - every call passes is_first_microbatch=None (the weight is re-quantized at each call: no cache that a no-grad
    lap leaves without its transpose), and fuse_wgrad_accumulation stays off (with it, a reused layer's backward can
    overwrite an earlier lap's gradient);
  - one te.autocast region per layer call, with the tp group as its amax reduction group;
  - activation checkpointing recomputes through te.distributed.checkpoint (it restores the FP8 state for the
    recomputed forward): :func:`convert_to_te` sets it as the model's checkpoint function.

Tensor parallelism: the layers are split by the same plan and layout object as without TE (pipeline/
tensor_parallel.py); TE runs as the local GEMM (parallel_mode=None, tp_size=1, Megatron's pattern for layers it
splits itself) and the row-parallel layer's sum over the group stays ours (exit_row_region).

TE needs CUDA even to construct a module: nothing here imports it until :func:`require_te` has checked for a GPU, so
on a CPU the backend fails with one line and `transformer_engine` is never imported (tested).
"""
from __future__ import annotations

import fnmatch
import functools
import importlib

import torch
from torch import nn

from pipeline.collectives import exit_row_region
from pipeline.fp8 import ALIGN, LINEAR_TYPES, Float8Report, split_of

EXTRA_STATE = "_extra_state"


class TransformerEngineUnavailable(RuntimeError):
    """Transformer Engine cannot run here; the message is one line saying why and what to do."""


def require_te():
    """transformer_engine.pytorch, or TransformerEngineUnavailable (one line) where there is no CUDA device or TE
    cannot be imported. CUDA is checked first, so a CPU machine never imports TE."""
    if not torch.cuda.is_available():
        raise TransformerEngineUnavailable(
            "train.fp8_backend=te needs a CUDA GPU (Transformer Engine cannot build a module without one); use "
            "train.fp8_backend=torchao here")
    try:
        return importlib.import_module("transformer_engine.pytorch")
    except (ImportError, OSError, RuntimeError, AssertionError) as err:
        raise TransformerEngineUnavailable(
            f"train.fp8_backend=te: transformer_engine.pytorch cannot be imported ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}); install it (pip install -r requirements-gpu.txt) or use "
            "train.fp8_backend=torchao") from err


def te_recipe(kind: str, calls_per_step: int):
    """The TE recipe for a module called `calls_per_step` times per step: "current" (Float8CurrentScaling) or
    "delayed" (DelayedScaling, only for modules called once per step). Checked before TE is imported."""
    if kind not in ("current", "delayed"):
        raise ValueError(f"TE recipe {kind!r}: use 'current' (Float8CurrentScaling) or 'delayed' (DelayedScaling)")
    if kind == "delayed" and calls_per_step > 1:
        raise ValueError(f"DelayedScaling keeps one amax history per module and this module runs {calls_per_step} "
                         "times per step (the loop): use Float8CurrentScaling ('current')")
    recipe = importlib.import_module("transformer_engine.common.recipe")
    return recipe.Float8CurrentScaling() if kind == "current" else recipe.DelayedScaling()


@functools.cache
def te_linear_class(row_parallel: bool) -> type:
    """te.Linear whose forward is one FP8 call in its own te.autocast region (is_first_microbatch=None); the
    row-parallel one sums its partial output over the tp group afterwards (the native RowParallelLinear's
    communication)."""
    te = require_te()

    class TELinear(te.Linear):
        fp8_recipe = None
        amax_group = None
        tp_group_native = None
        sequence_parallel_native = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with te.autocast(enabled=True, recipe=self.fp8_recipe, amax_reduction_group=self.amax_group):
                y = super().forward(x, is_first_microbatch=None)
            if row_parallel:
                return exit_row_region(y, self.tp_group_native, self.sequence_parallel_native)
            return y

    TELinear.__name__ = "TERowParallelLinear" if row_parallel else "TELinear"
    return TELinear


def make_te_linear(module: nn.Linear, recipe, tp_group) -> nn.Module:
    """A TE linear layer holding `module`'s weight Parameter itself (same name, same storage)."""
    row = split_of(module) == "row"
    out_features, in_features = module.weight.shape
    new = te_linear_class(row)(in_features, out_features, bias=False, params_dtype=module.weight.dtype,
                               device=module.weight.device, parallel_mode=None, tp_size=1,
                               fuse_wgrad_accumulation=False)
    new.weight = module.weight  # the native Parameter: optimizer, checkpoints and tp shard specs see no change
    new.fp8_recipe, new.amax_group = recipe, tp_group
    if row:
        new.tp_group_native, new.sequence_parallel_native = module.tp_group, module.sequence_parallel
    return new


def te_checkpoint(function, *args):
    """Activation recompute through te.distributed.checkpoint (restores the FP8 state of the recomputed forward)."""
    te = require_te()
    return te.distributed.checkpoint(function, *args, use_reentrant=False)


def convert_to_te(model: nn.Module, include: tuple[str, ...], tp_group=None) -> Float8Report:
    """Replace the linear layers whose names match `include` by TE linear layers (Float8CurrentScaling, see the
    module docstring), in place; set te_checkpoint as the model's recompute function. Skips as convert_to_float8."""
    require_te()
    recipe = te_recipe("current", calls_per_step=2)  # the core runs T times per step
    report = Float8Report("te current scaling")
    for name, module in list(model.named_modules()):
        if type(module) not in LINEAR_TYPES or not any(fnmatch.fnmatchcase(name, p) for p in include):
            continue
        n, k = module.weight.shape
        if module.weight.is_meta:  # another pipeline stage's layer: this rank never runs it
            continue
        if module.bias is not None or n % ALIGN or k % ALIGN:
            report.skipped.append(f"{name} ({'bias' if module.bias is not None else f'{k}->{n}'})")
            continue
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, make_te_linear(module, recipe, tp_group))
        report.converted.append(name)
    if hasattr(model, "checkpoint_function"):
        model.checkpoint_function = te_checkpoint
    return report


def te_state_keys(model: nn.Module, include: tuple[str, ...]) -> list[str]:
    """The state_dict keys `model` (native) will have once convert_to_te(model, include) has run: its own keys, each
    converted layer's `_extra_state` right after its weight (a leaf module saves its parameters, then its extra
    state). Lets a checkpoint tool map keys without a GPU."""
    converted = {f"{name}.weight" for name, m in model.named_modules()
                 if type(m) in LINEAR_TYPES and any(fnmatch.fnmatchcase(name, p) for p in include)
                 and m.bias is None and not m.weight.shape[0] % ALIGN and not m.weight.shape[1] % ALIGN}
    keys = []
    for key in model.state_dict():
        keys.append(key)
        if key in converted:
            keys.append(f"{key.rsplit('.', 1)[0]}.{EXTRA_STATE}")
    return keys


def te_to_native(state: dict) -> dict:
    """A TE model's state_dict as the native model's: the `_extra_state` keys dropped, every other key as is."""
    return {k: v for k, v in state.items() if k.rsplit(".", 1)[-1] != EXTRA_STATE}


def native_to_te(state: dict, te_keys, extra_states: dict | None = None) -> dict:
    """A native state_dict for a TE model whose state_dict keys are `te_keys`: each `_extra_state` key taken from
    `extra_states` (a TE model's own; default: empty, TE's "no FP8 metadata yet"), every other key as is. A key of
    either side that the other lacks is an error naming it."""
    extra_states = extra_states or {}
    te_keys = list(te_keys)
    params = [k for k in te_keys if k.rsplit(".", 1)[-1] != EXTRA_STATE]
    missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    if missing or unexpected:
        raise KeyError(f"native state and TE model differ: missing {missing[:4]}, unexpected {unexpected[:4]}")
    return {k: (extra_states.get(k, torch.empty(0)) if k.rsplit(".", 1)[-1] == EXTRA_STATE else state[k])
            for k in te_keys}
