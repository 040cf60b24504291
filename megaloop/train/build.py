"""Materialise the parameters a rank holds, and nothing else, on a model built on the meta device: its tensor-parallel
shards, optionally only of a named subset (a pipeline stage's parameters, megaloop.model.stages.stage_parameter_names).

Each parameter's value is a pure function of (seed, name, full shape) (megaloop.model.init), so a rank computes the
full initial value of one parameter at a time (float32 on the CPU, as an eager build does), keeps its shard and
drops the rest: the parameters it holds are bit for bit those of a single-process build cut by the same shard specs,
and its memory never holds more than its shards plus one full parameter in flight.

Splitting the init over data-parallel ranks (InitSplit): the ranks of one data-parallel group hold the same
parameters, so each computes only the parameters it owns (dealt by cost, largest first to the least loaded rank) and
then broadcasts them to the others: the init takes ~1/dp of the time (the QRs dominate; see init_parameter_cost) for
one broadcast of the parameters. The values are the owner's, computed as above, so the result is bit for bit the one
every rank would compute alone. Running the init on the GPU instead would not be exact: the reference values are
float64 LAPACK QRs on one CPU thread, which cuSOLVER does not reproduce.

A resumed job (empty_parameters) allocates what it holds without initialising anything: the checkpoint fills it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from megaloop.model.init import init_parameter, init_parameter_cost, materialize
from pipeline.dist_muon import assign_owners
from pipeline.tensor_parallel import shard_tensor


@dataclass(frozen=True)
class InitSplit:
    """The ranks that hold the same parameters (one data-parallel group): `ranks` global ranks in group order, this
    rank at `index`, `group` their process group."""

    group: object
    ranks: tuple[int, ...]
    index: int


def full_shape(local_shape, spec) -> list[int]:
    """The whole parameter's shape from a shard's (spec None: not split)."""
    shape = list(local_shape)
    if spec is not None:
        shape[spec.dim] *= spec.tp
    return shape


def held_parameters(model_cfg, seed: int, device: torch.device, names: Optional[Iterable[str]] = None,
                    split: Optional[InitSplit] = None) -> Callable:
    """materialize(model, tp_info) for ParallelRuntime.prepare_model: every meta parameter of the split model (only
    those in `names` when given; the others stay on the meta device, allocating nothing) becomes this rank's piece of
    its reference initial value, in the dtype the meta parameter has, on `device`; the RoPE tables are computed as
    an eager build makes them. tp_info None: nothing is split (a single process). With `split`, the ranks of
    split.group each compute a share and broadcast it (see the module docstring); every one of them must call."""
    wanted = None if names is None else set(names)

    @torch.no_grad()
    def fill(model: nn.Module, tp_info) -> None:
        params = _selected(model, wanted)
        shards = {} if tp_info is None else tp_info.shards
        shapes = [full_shape(p.shape, shards.get(name)) for name, p in params]
        owners = _owners([name for name, _ in params], shapes, split)
        for (name, p), shape, owner in zip(params, shapes, owners):
            if owner == (split.index if split else 0):
                value = init_parameter(model_cfg, name, shape, seed)  # float32, CPU
                if shards.get(name) is not None:
                    value = shard_tensor(value, shards[name], tp_info.tp_rank)
                value = value.to(device=device, dtype=p.dtype)
            else:
                value = torch.empty(p.shape, device=device, dtype=p.dtype)  # the owner's broadcast fills it
            _replace(model, name, nn.Parameter(value, requires_grad=p.requires_grad))
        if split is not None:
            _broadcast_from_owners(model, [name for name, _ in params], owners, split)
        materialize(model, names=[], device=device, dtype=_param_dtype(model))  # the buffers only

    return fill


def empty_parameters(device: torch.device, names: Optional[Iterable[str]] = None) -> Callable:
    """materialize(model, tp_info) for a job that loads every parameter it holds from a checkpoint: allocated
    (torch.empty) on `device` in their dtype, never initialised; the RoPE tables (functions of the config) computed
    as held_parameters does. The checkpoint load must then fill every parameter (checkpointing.load_model refuses a
    missing one)."""
    wanted = None if names is None else set(names)

    @torch.no_grad()
    def fill(model: nn.Module, tp_info) -> None:
        for name, p in _selected(model, wanted):
            _replace(model, name, nn.Parameter(torch.empty(p.shape, device=device, dtype=p.dtype),
                                               requires_grad=p.requires_grad))
        materialize(model, names=[], device=device, dtype=_param_dtype(model))  # the buffers only

    return fill


def _replace(model: nn.Module, name: str, param: nn.Parameter) -> None:
    module_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(module_name), leaf, param)


def _owners(names: list[str], shapes: list[list[int]], split: Optional[InitSplit]) -> list[int]:
    """Which rank of the split computes each parameter (all 0 without one): by init cost, balanced."""
    if split is None or len(split.ranks) == 1:
        return [0] * len(names)
    costs = [init_parameter_cost(name, shape) for name, shape in zip(names, shapes)]
    return assign_owners(costs, len(split.ranks))


def _broadcast_from_owners(model: nn.Module, names: list[str], owners: list[int], split: InitSplit) -> None:
    """Every parameter from the rank that computed it to the others of the split (asynchronous, then waited)."""
    if len(split.ranks) == 1:
        return
    params = dict(model.named_parameters())
    works = [dist.broadcast(params[name].data, src=split.ranks[owner], group=split.group, async_op=True)
             for name, owner in zip(names, owners)]
    for work in works:
        work.wait()


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
