"""Apply a tensor-parallel plan (module-name patterns -> styles, see megaloop/model/tp_plan.py) to a built model.

The model is built whole on every rank (same seed, same values), then each split parameter is replaced by this
rank's shard under the same name, and forward hooks add the communication at region boundaries (see
collectives.py). Parameter names do not change, so checkpoints and optimizer grouping see the same names.

The split is described per parameter by a :class:`ShardSpec` (dimension, number of equal parts that are split
separately, tp size): the same description serves gathering a full tensor (distributed Muon, checkpoints, tests),
and a Transformer Engine backend, whose Linear takes parallel_mode "column"/"row", a tp_group and
sequence_parallel, can be given the very same group and flags instead of these hooks.
"""
from __future__ import annotations

import fnmatch
import types
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.collectives import all_gather_along, enter_column_region, exit_row_region, group_rank, group_size
from pipeline.grad_buffer import flat_all_reduce_

SPLIT_STYLES = ("vocab", "column", "column-paired", "row")
HOOK_STYLES = ("enter", "gather-output")
REPLICATED_STYLES = ("replicate-sequence-parallel", "replicate")
STYLES = SPLIT_STYLES + HOOK_STYLES + REPLICATED_STYLES


@dataclass(frozen=True)
class ShardSpec:
    """How a parameter is split over the tensor-parallel group: `dim` cut into `parts` equal blocks, each block cut
    into `tp` equal pieces; rank r holds piece r of every block, concatenated (parts=1: a plain contiguous split)."""

    dim: int
    tp: int
    parts: int = 1


def shard_tensor(full: torch.Tensor, spec: ShardSpec, rank: int) -> torch.Tensor:
    """Rank `rank`'s shard of `full`."""
    size = full.shape[spec.dim]
    if size % (spec.parts * spec.tp):
        raise ValueError(f"dimension {spec.dim} of size {size} does not split into {spec.parts} part(s) x "
                         f"{spec.tp} tensor-parallel ranks")
    blocks = full.chunk(spec.parts, dim=spec.dim)
    return torch.cat([b.chunk(spec.tp, dim=spec.dim)[rank] for b in blocks], dim=spec.dim).contiguous()


def unshard_tensor(shards: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """The full tensor from every rank's shard (in rank order); inverse of :func:`shard_tensor`."""
    pieces = [s.chunk(spec.parts, dim=spec.dim) for s in shards]
    return torch.cat([pieces[r][p] for p in range(spec.parts) for r in range(len(shards))], dim=spec.dim)


def gather_full(local: torch.Tensor, spec: ShardSpec | None, group) -> torch.Tensor:
    """All-gather a sharded tensor into its full value on every rank of `group` (replicated: returned as is)."""
    if spec is None or group is None:
        return local
    stacked = all_gather_along(local.detach().unsqueeze(0), 0, group)
    return unshard_tensor(list(stacked.unbind(0)), spec)


@dataclass
class TensorParallelInfo:
    """What applying a plan did: the shard spec of each split parameter, the replicated parameters whose
    gradients are partial sums over the tp group (sequence parallelism) and the vocabulary range of this rank."""

    tp: int = 1
    tp_rank: int = 0
    sequence_parallel: bool = False
    shards: dict[str, ShardSpec] = field(default_factory=dict)
    partial_grad: list[str] = field(default_factory=list)
    replicated: list[str] = field(default_factory=list)
    vocab_range: tuple[int, int] | None = None


def _matching_styles(name: str, plan) -> list[str]:
    styles = [style for pattern, style in plan if fnmatch.fnmatchcase(name, pattern)]
    for style in styles:
        if style not in STYLES:
            raise ValueError(f"tensor-parallel plan: unknown style {style!r} for {name!r}; allowed: {STYLES}")
    return styles


def _replace_param(module: nn.Module, pname: str, spec: ShardSpec, rank: int) -> None:
    old = getattr(module, pname)
    new = nn.Parameter(shard_tensor(old.detach(), spec, rank), requires_grad=old.requires_grad)
    setattr(module, pname, new)


def _split_module(module: nn.Module, style: str, tp: int, rank: int) -> ShardSpec:
    """Replace the module's weight by its shard and fix its size attributes; return the spec."""
    if isinstance(module, nn.Embedding):
        dim = 0 if style == "vocab" else 1
    elif isinstance(module, nn.Linear):
        if style == "vocab":
            raise ValueError("style 'vocab' applies to nn.Embedding modules only")
        dim = 1 if style == "row" else 0
        if module.bias is not None:
            raise ValueError("tensor parallelism here splits bias-free Linear layers only (the looped LM has none)")
    else:
        raise TypeError(f"style {style!r} needs an nn.Linear or nn.Embedding, got {type(module).__name__}")
    spec = ShardSpec(dim, tp, 2 if style == "column-paired" else 1)
    _replace_param(module, "weight", spec, rank)
    if isinstance(module, nn.Linear):
        module.out_features, module.in_features = module.weight.shape
    else:
        module.num_embeddings, module.embedding_dim = module.weight.shape
    return spec


def _vocab_parallel_forward(group, sequence_parallel: bool, start: int, end: int):
    """forward for a vocabulary-split nn.Embedding: look up the ids this rank owns, zero the rest, sum the group."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < start) | (ids >= end)
        local_ids = (ids - start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight, None, self.max_norm, self.norm_type, self.scale_grad_by_freq,
                          self.sparse)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return exit_row_region(out, group, sequence_parallel)

    return forward


def _add_hooks(module: nn.Module, style: str, group, sequence_parallel: bool) -> None:
    if style == "enter":
        def enter_hook(_module, args):
            return (enter_column_region(args[0], group, sequence_parallel), *args[1:])
        module.register_forward_pre_hook(enter_hook)
    elif style == "gather-output":
        module.register_forward_hook(lambda _m, _a, out: enter_column_region(out, group, sequence_parallel))
    elif style == "row":
        module.register_forward_hook(lambda _m, _a, out: exit_row_region(out, group, sequence_parallel))


def apply_tensor_parallel(model: nn.Module, plan, layout) -> TensorParallelInfo:
    """Split `model` in place by `plan` for this rank of `layout` (tp, tp_group, sequence_parallel) and return
    the :class:`TensorParallelInfo`. With tp 1 nothing changes (every parameter is recorded as replicated).
    Raises ValueError when a parameter is covered by no rule (a new module must be added to the plan)."""
    tp, group = layout.tp, layout.tp_group
    rank = group_rank(group)
    sp = bool(layout.sequence_parallel and tp > 1)
    if tp != group_size(group):
        raise ValueError(f"layout.tp={tp} but its tp_group has {group_size(group)} ranks")
    info = TensorParallelInfo(tp=tp, tp_rank=rank, sequence_parallel=sp)
    covered: set[str] = set()
    for mname, module in list(model.named_modules()):
        styles = _matching_styles(mname, plan)
        pnames = [f"{mname}.{p}" if mname else p for p, _ in module.named_parameters(recurse=False)]
        for style in styles:
            if style in SPLIT_STYLES and tp > 1:
                spec = _split_module(module, style, tp, rank)
                info.shards.update({n: spec for n in pnames if n.endswith(".weight")})
                if style == "vocab":
                    per_rank = module.weight.shape[0]
                    info.vocab_range = (rank * per_rank, (rank + 1) * per_rank)
                    module.forward = types.MethodType(
                        _vocab_parallel_forward(group, sp, *info.vocab_range), module)
            if style in SPLIT_STYLES + REPLICATED_STYLES:
                covered.update(pnames)
            if style == "replicate-sequence-parallel" and sp:
                info.partial_grad.extend(n for n in pnames if n not in info.partial_grad)
            if tp > 1:
                _add_hooks(module, style, group, sp)
    _check_coverage(model, covered, info)
    return info


def _check_coverage(model: nn.Module, covered: set[str], info: TensorParallelInfo) -> None:
    missing = []
    for name, _ in model.named_parameters():
        if name not in covered:
            missing.append(name)
        elif name not in info.shards:
            info.replicated.append(name)
    if missing:
        raise ValueError(f"tensor-parallel plan covers no rule for parameters {missing[:8]}; add the module to "
                         "the plan (column/row/vocab/replicate-sequence-parallel)")


@torch.no_grad()
def reduce_partial_grads(model: nn.Module, info: TensorParallelInfo, group) -> None:
    """Sum over the tp group the gradients of replicated parameters that saw only this rank's positions
    (sequence parallelism), in one flat all-reduce. A missing gradient counts as zero (and is created), so every
    rank issues the same collective."""
    if group is None or not info.partial_grad:
        return
    params = dict(model.named_parameters())
    targets = [params[name] for name in info.partial_grad]
    for p in targets:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat_all_reduce_([p.grad for p in targets], group)
