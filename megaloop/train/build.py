"""Materialise the parameters a rank holds, and nothing else, on a model built on the meta device: its tensor-parallel
shards, optionally only of a named subset (a pipeline stage's parameters, megaloop.model.stages.stage_parameter_names).

Each parameter's value is a pure function of (seed, name, full shape) (megaloop.model.init), so a rank computes the
full initial value of one parameter at a time (float32 on the CPU, as an eager build does), keeps its shard and
drops the rest: the parameters it holds are bit for bit those of a single-process build cut by the same shard specs,
and its memory never holds more than its shards plus one full parameter in flight.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch
from torch import nn

from megaloop.model.init import init_parameter, materialize
from pipeline.tensor_parallel import shard_tensor


def full_shape(local_shape, spec) -> list[int]:
    """The whole parameter's shape from a shard's (spec None: not split)."""
    shape = list(local_shape)
    if spec is not None:
        shape[spec.dim] *= spec.tp
    return shape


def held_parameters(model_cfg, seed: int, device: torch.device, names: Optional[Iterable[str]] = None) -> Callable:
    """materialize(model, tp_info) for ParallelRuntime.prepare_model: every meta parameter of the split model (only
    those in `names` when given; the others stay on the meta device, allocating nothing) becomes this rank's piece of
    its reference initial value, in the dtype the meta parameter has, on `device`; the RoPE tables are computed as
    an eager build makes them."""
    wanted = None if names is None else set(names)

    @torch.no_grad()
    def fill(model: nn.Module, tp_info) -> None:
        for name, p in _selected(model, wanted):
            spec = tp_info.shards.get(name)
            value = init_parameter(model_cfg, name, full_shape(p.shape, spec), seed)  # float32, CPU
            if spec is not None:
                value = shard_tensor(value, spec, tp_info.tp_rank)
            module_name, _, leaf = name.rpartition(".")
            held = nn.Parameter(value.to(device=device, dtype=p.dtype), requires_grad=p.requires_grad)
            setattr(model.get_submodule(module_name), leaf, held)
        materialize(model, names=[], device=device, dtype=_param_dtype(model))  # the buffers only

    return fill


def _selected(model: nn.Module, wanted: Optional[set]) -> list:
    """(name, parameter) of the model's parameters in `wanted` (all when None); unknown names are an error."""
    params = list(model.named_parameters())
    if wanted is None:
        return params
    unknown = sorted(wanted - {name for name, _ in params})
    if unknown:
        raise ValueError(f"held_parameters: not parameters of this model: {unknown[:5]}; pass names as "
                         f"model.named_parameters() gives them (e.g. from stage_parameter_names)")
    return [(name, p) for name, p in params if name in wanted]


def _param_dtype(model: nn.Module) -> torch.dtype:
    """The parameters' dtype (float32 for a model without any)."""
    return next((p.dtype for p in model.parameters()), torch.float32)
