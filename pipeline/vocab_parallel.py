"""The vocabulary split over the tensor-parallel group: the embedding (VocabParallelEmbedding) and the
cross-entropy over logits split along the vocabulary, without gathering them. The tied head reuses the embedding's
shard, so the logits of rank r are those of its vocabulary rows.

Cross-entropy: rank r holds logits z[..., start_r:end_r]. Per token: m = max over the group of the local maxima (for
stability), S = sum over the group of sum(exp(z_local - m)), z_y = the target's logit (found on the rank that owns
it, summed over the group), loss = log S - (z_y - m). Backward: softmax_local - onehot_local, with no communication.
Every rank of the group ends with the same per-token losses (they are the full cross-entropy).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeline.collectives import all_reduce_, exit_row_region

IGNORE_INDEX = -100


class VocabParallelEmbedding(nn.Embedding):
    """nn.Embedding holding rows vocab_start .. vocab_end - 1 of the full table (made by
    pipeline.tensor_parallel.apply_tensor_parallel). forward: look up the ids this rank owns, zeros for the others,
    then sum over the group with exit_row_region (all-reduce; under sequence parallelism a reduce-scatter along the
    sequence), so every rank ends with the full embedding of its positions."""

    vocab_start: int = 0
    vocab_end: int = 0
    tp_group = None
    sequence_parallel: bool = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight, None, self.max_norm, self.norm_type, self.scale_grad_by_freq,
                          self.sparse)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return exit_row_region(out, self.tp_group, self.sequence_parallel)


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, start, group):
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        vocab_local = logits.shape[-1]
        local_max = logits.detach().amax(dim=-1)
        global_max = all_reduce_(local_max.clone(), group, op=dist.ReduceOp.MAX)
        shifted = logits - global_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = all_reduce_(exp.sum(dim=-1), group)
        valid = labels != IGNORE_INDEX
        local_target = labels - start
        mine = valid & (local_target >= 0) & (local_target < vocab_local)
        index = local_target.masked_fill(~mine, 0)
        target_logit = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        target_logit = all_reduce_(target_logit, group)
        loss = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, index, mine, valid)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, index, mine, valid = ctx.saved_tensors
        grad = softmax
        grad.scatter_add_(-1, index.unsqueeze(-1), -mine.to(grad.dtype).unsqueeze(-1))
        grad.mul_((grad_loss * valid.to(grad_loss.dtype)).unsqueeze(-1))
        return grad, None, None, None


def vocab_parallel_cross_entropy_per_token(local_logits: torch.Tensor, labels: torch.Tensor, vocab_start: int,
                                           group) -> torch.Tensor:
    """Per-token losses (0 where labels == -100), shape of `labels`, from this rank's vocabulary slice of the
    logits [..., V/tp] starting at global id `vocab_start`. The saved softmax reuses the logits' memory pattern."""
    if local_logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(local_logits.shape)} and labels {tuple(labels.shape)} do not match")
    return _VocabParallelCE.apply(local_logits, labels, vocab_start, group)


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, labels: torch.Tensor, layout,
                                 vocab_start: int | None = None, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of the full-vocabulary softmax from vocabulary-split logits, like F.cross_entropy with
    ignore_index=-100. `layout` supplies tp and tp_group; `vocab_start` defaults to tp_rank * local vocab size.
    reduction: "mean" (over non-ignored tokens), "sum" or "none"."""
    group = layout.tp_group if layout.tp > 1 else None
    if vocab_start is None:
        vocab_start = (layout.tp_rank if layout.tp > 1 else 0) * local_logits.shape[-1]
    losses = vocab_parallel_cross_entropy_per_token(local_logits, labels, vocab_start, group)
    if reduction == "none":
        return losses
    total = losses.sum()
    if reduction == "sum":
        return total
    if reduction != "mean":
        raise ValueError(f"reduction={reduction!r}: allowed mean, sum, none")
    return total / (labels != IGNORE_INDEX).sum().clamp_min(1)
