"""Communication for tensor and sequence parallelism, as autograd functions over an explicit process group.

The four region boundaries of Megatron-style tensor parallelism (activations are [batch, seq, hidden]; the
sequence dimension is dim 1):

    enter_tp(x)          forward identity,          backward all-reduce     (input of column-parallel layers)
    exit_tp(x)           forward all-reduce,        backward identity       (output of row-parallel layers)
    gather_seq(x)        forward all-gather seq,    backward reduce-scatter (sequence-parallel -> column input)
    reduce_scatter_seq(x) forward reduce-scatter,   backward all-gather     (row output -> sequence-parallel)

plus split_seq (forward: this rank's sequence chunk; backward: all-gather) for tensors that are replicated but must
enter the sequence-parallel region (the initial loop state). Every function is the identity when the group is None
(tensor-parallel size 1), so code using them needs no special case for one process. The parallel modules call them
through enter_column_region (ColumnRegionInput / ColumnRegionOutput in tensor_parallel.py) and exit_row_region
(RowParallelLinear, VocabParallelEmbedding), which pick the sequence-parallel pair or the plain one.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

SEQ_DIM = 1


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce_(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce (nothing for a None group); returns the tensor."""
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _gather_dim0(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_single(out, x.contiguous(), group=group)
    return out


def _reduce_scatter_dim0(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    if x.shape[0] % size:
        raise ValueError(f"cannot reduce-scatter {x.shape[0]} rows over {size} ranks")
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_single(out, x.contiguous(), group=group)
    return out


def all_gather_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's x along `dim` (rank order). No autograd."""
    if group is None:
        return x
    moved = x.movedim(dim, 0)
    return _gather_dim0(moved, group).movedim(0, dim)


def reduce_scatter_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum x over the group and keep this rank's chunk along `dim`. No autograd."""
    if group is None:
        return x
    size = group_size(group)
    if x.shape[dim] % size:
        raise ValueError(f"sequence parallelism: dimension {dim} of size {x.shape[dim]} does not split over "
                         f"{size} tensor-parallel ranks; use a sequence length divisible by tp")
    moved = x.movedim(dim, 0)
    return _reduce_scatter_dim0(moved, group).movedim(0, dim)


def chunk_along(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's contiguous chunk of x along `dim`."""
    if group is None:
        return x
    size = group_size(group)
    if x.shape[dim] % size:
        raise ValueError(f"sequence parallelism: dimension {dim} of size {x.shape[dim]} does not split over "
                         f"{size} tensor-parallel ranks; use a sequence length divisible by tp")
    return x.chunk(size, dim=dim)[group_rank(group)].contiguous()


class _EnterTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_(grad.contiguous().clone(), ctx.group), None


class _ExitTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _sequence_function(name: str, forward_op, backward_op):
    """An autograd function applying forward_op along the sequence dim and its conjugate backward_op to the grad."""

    def forward(ctx, x, group):
        ctx.group = group
        return forward_op(x, SEQ_DIM, group)

    def backward(ctx, grad):
        return backward_op(grad, SEQ_DIM, ctx.group), None

    methods = {"forward": staticmethod(forward), "backward": staticmethod(backward)}
    return type(name, (torch.autograd.Function,), methods)


# all-gather <-> reduce-scatter are each other's adjoints; a split's adjoint is the all-gather
_GatherSeq = _sequence_function("_GatherSeq", all_gather_along, reduce_scatter_along)
_ReduceScatterSeq = _sequence_function("_ReduceScatterSeq", reduce_scatter_along, all_gather_along)
_SplitSeq = _sequence_function("_SplitSeq", chunk_along, all_gather_along)


def enter_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _EnterTP.apply(x, group)


def exit_tp(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _ExitTP.apply(x, group)


def gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _GatherSeq.apply(x, group)


def reduce_scatter_seq(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _ReduceScatterSeq.apply(x, group)


def split_seq(x: torch.Tensor, group) -> torch.Tensor:
    return x if group is None else _SplitSeq.apply(x, group)


def enter_column_region(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """The input of column-parallel layers: all-gather the sequence (SP) or mark the all-reduce of its grad."""
    return gather_seq(x, group) if sequence_parallel else enter_tp(x, group)


def exit_row_region(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """The partial sums out of a row-parallel layer: reduce-scatter along the sequence (SP) or all-reduce."""
    return reduce_scatter_seq(x, group) if sequence_parallel else exit_tp(x, group)
