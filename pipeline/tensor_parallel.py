"""Apply a tensor-parallel plan (module-name patterns -> styles, see megaloop/model/tp_plan.py) to a built model.

Every module a style touches is swapped for an explicit parallel module whose forward states its communication
(the region boundaries of collectives.py):

    ColumnParallelLinear     nn.Linear with this rank's output features; no communication (its input is already
                             in the column-parallel region, its output stays split)
    RowParallelLinear        nn.Linear with this rank's input features; partial outputs summed over the group
                             (all-reduce, or reduce-scatter along the sequence under sequence parallelism)
    ColumnParallelEmbedding  nn.Embedding with this rank's embedding columns; no communication
    VocabParallelEmbedding   nn.Embedding with this rank's vocabulary rows (pipeline/vocab_parallel.py)
    ColumnRegionInput<M>     module M (attention, MLP) whose input first enters the column-parallel region
    ColumnRegionOutput<M>    module M (the final norm) whose output enters the column-parallel region

The parallel module takes over the replaced module's state (parameters, children, settings), the split weight
replaced by this rank's shard, so parameter names do not change: checkpoints, optimizer grouping and the plan see
the same names. The two region classes are made from the model's own class (a mixin in front of it, e.g.
ColumnRegionInputAttention), since pipeline does not import the model's modules.

The split is described per parameter by a :class:`ShardSpec` (dimension, number of equal parts that are split
separately, tp size): the same description serves gathering a full tensor (distributed Muon, checkpoints, tests),
and a Transformer Engine backend, whose Linear takes parallel_mode "column"/"row", a tp_group and
sequence_parallel, can be given the very same group and flags instead of these modules. A model built on the meta
device is split the same way (shards of meta tensors), so a rank can materialise only what it holds.
"""
from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.collectives import all_gather_along, enter_column_region, exit_row_region, group_rank, group_size
from pipeline.grad_buffer import flat_all_reduce_
from pipeline.vocab_parallel import VocabParallelEmbedding

SPLIT_STYLES = ("vocab", "column", "column-paired", "row")
REGION_STYLES = ("enter", "gather-output")
REPLICATED_STYLES = ("replicate-sequence-parallel", "replicate")
STYLES = SPLIT_STYLES + REGION_STYLES + REPLICATED_STYLES


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


class ColumnParallelLinear(nn.Linear):
    """nn.Linear holding this rank's output features (rows of the full weight, see its `shard`): y_r = x W_r^T.
    No communication: x is already in the column-parallel region (the enclosing attention or MLP entered it, see
    ColumnRegionInput) and y_r stays split (this rank's heads or hidden units)."""

    shard: ShardSpec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Linear):
    """nn.Linear holding this rank's input features (columns of the full weight): x_r W_r^T is this rank's partial
    sum of the output, which exit_row_region sums over the tensor-parallel group (all-reduce; under sequence
    parallelism a reduce-scatter along the sequence, leaving this rank's positions)."""

    shard: ShardSpec
    tp_group = None
    sequence_parallel: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return exit_row_region(F.linear(x, self.weight), self.tp_group, self.sequence_parallel)


class ColumnParallelEmbedding(nn.Embedding):
    """nn.Embedding holding this rank's embedding columns of every row (value embeddings, split along kv heads
    like the attention's v): a plain lookup of every id, no communication; the vectors stay split."""

    shard: ShardSpec

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight, self.padding_idx, self.max_norm, self.norm_type, self.scale_grad_by_freq,
                           self.sparse)


class ColumnRegionInput:
    """The "enter" style, put in front of the class of a module whose input starts a column-parallel region
    (attention, MLP): the input x is all-gathered along the sequence under sequence parallelism (else passed as
    is, its gradient all-reduced over the group), then the module's own forward runs, unchanged."""

    tp_group = None
    sequence_parallel: bool = False

    def forward(self, x: torch.Tensor, *args, **kwargs):
        return super().forward(enter_column_region(x, self.tp_group, self.sequence_parallel), *args, **kwargs)


class ColumnRegionOutput:
    """The "gather-output" style: the module's own forward, then its output enters the column-parallel region (the
    final norm, whose output feeds the vocabulary-parallel head: all-gathered along the sequence under sequence
    parallelism, else passed as is with its gradient all-reduced)."""

    tp_group = None
    sequence_parallel: bool = False

    def forward(self, *args, **kwargs):
        return enter_column_region(super().forward(*args, **kwargs), self.tp_group, self.sequence_parallel)


@functools.cache
def region_class(region: type, base: type) -> type:
    """The class `base` with the region class in front, e.g. ColumnRegionInput + Attention ->
    ColumnRegionInputAttention (everything but the added communication is base's)."""
    return type(f"{region.__name__}{base.__name__}", (region, base), {"__doc__": region.__doc__})


# (style, exact module type) -> (parallel class, split dimension of the weight, equal parts split separately)
SPLITS = {
    ("vocab", nn.Embedding): (VocabParallelEmbedding, 0, 1),
    ("column", nn.Embedding): (ColumnParallelEmbedding, 1, 1),
    ("column", nn.Linear): (ColumnParallelLinear, 0, 1),
    ("column-paired", nn.Linear): (ColumnParallelLinear, 0, 2),
    ("row", nn.Linear): (RowParallelLinear, 1, 1),
}
REGIONS = {"enter": ColumnRegionInput, "gather-output": ColumnRegionOutput}


def take_over(cls: type, module: nn.Module, **settings) -> nn.Module:
    """A new `cls` instance holding `module`'s state (parameters, buffers, children, attributes; the dicts are
    copied, their values shared) plus `settings`. `cls` must subclass module's type, so everything but the
    forward's communication stays the module's own. The caller puts it in module's place."""
    if not issubclass(cls, type(module)):
        raise TypeError(f"{cls.__name__} does not subclass {type(module).__name__}")
    new = cls.__new__(cls)
    new.__dict__.update(module.__dict__)
    for name in ("_parameters", "_buffers", "_modules"):
        new.__dict__[name] = dict(module.__dict__[name])
    for name, value in settings.items():
        setattr(new, name, value)
    return new


def _matching_styles(name: str, plan) -> list[str]:
    styles = [style for pattern, style in plan if fnmatch.fnmatchcase(name, pattern)]
    for style in styles:
        if style not in STYLES:
            raise ValueError(f"tensor-parallel plan: unknown style {style!r} for {name!r}; allowed: {STYLES}")
    return styles


def split_module(module: nn.Module, style: str, tp: int, rank: int, group, sequence_parallel: bool) -> nn.Module:
    """The parallel module for a split style (see SPLITS): module's state with its weight cut to this rank's shard
    (`.shard` is its ShardSpec) and its size attributes fixed."""
    key = (style, type(module))
    if key not in SPLITS:
        allowed = sorted({f"{s} on nn.{t.__name__}" for s, t in SPLITS})
        raise TypeError(f"tensor-parallel style {style!r} cannot split a {type(module).__name__}; allowed: "
                        f"{allowed} (plain torch modules: a subclass with its own forward needs its own parallel "
                        "class)")
    if getattr(module, "bias", None) is not None:
        raise ValueError("tensor parallelism here splits bias-free Linear layers only (the looped LM has none)")
    cls, dim, parts = SPLITS[key]
    spec = ShardSpec(dim, tp, parts)
    communicates = hasattr(cls, "tp_group")  # the classes that sum over the group declare it
    group_settings = {"tp_group": group, "sequence_parallel": sequence_parallel} if communicates else {}
    new = take_over(cls, module, shard=spec, **group_settings)
    new.weight = nn.Parameter(shard_tensor(module.weight.detach(), spec, rank),
                              requires_grad=module.weight.requires_grad)
    if isinstance(new, nn.Linear):
        new.out_features, new.in_features = new.weight.shape
    else:
        new.num_embeddings, new.embedding_dim = new.weight.shape
    if cls is VocabParallelEmbedding:
        new.vocab_start, new.vocab_end = rank * new.num_embeddings, (rank + 1) * new.num_embeddings
    return new


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put `new` in place of the submodule called `name`."""
    if not name:
        raise ValueError("a tensor-parallel plan cannot split or wrap the model itself; name its submodules")
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, new)


def apply_tensor_parallel(model: nn.Module, plan, layout) -> TensorParallelInfo:
    """Split `model` in place by `plan` for this rank of `layout` (tp, tp_group, sequence_parallel): each module
    with a split or region style is swapped for its parallel module (see the module docstring), and the
    :class:`TensorParallelInfo` is returned. With tp 1 nothing changes (every parameter is recorded as replicated).
    Raises ValueError when a parameter is covered by no rule (a new module must be added to the plan)."""
    tp, group = layout.tp, layout.tp_group
    rank = group_rank(group)
    sp = bool(layout.sequence_parallel and tp > 1)
    if tp != group_size(group):
        raise ValueError(f"layout.tp={tp} but its tp_group has {group_size(group)} ranks")
    info = TensorParallelInfo(tp=tp, tp_rank=rank, sequence_parallel=sp)
    covered: set[str] = set()
    for mname, module in list(model.named_modules()):
        pnames = [f"{mname}.{p}" if mname else p for p, _ in module.named_parameters(recurse=False)]
        current = module
        for style in _matching_styles(mname, plan):
            if style in SPLIT_STYLES and tp > 1:
                current = split_module(current, style, tp, rank, group, sp)
                info.shards.update({n: current.shard for n in pnames if n.endswith(".weight")})
                if style == "vocab":
                    info.vocab_range = (current.vocab_start, current.vocab_end)
            elif style in REGION_STYLES and tp > 1:
                current = take_over(region_class(REGIONS[style], type(current)), current, tp_group=group,
                                    sequence_parallel=sp)
            if style in SPLIT_STYLES + REPLICATED_STYLES:
                covered.update(pnames)
            if style == "replicate-sequence-parallel" and sp:
                info.partial_grad.extend(n for n in pnames if n not in info.partial_grad)
        if current is not module:
            _swap(model, mname, current)
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
