"""Data-parallel gradient reduction: one bucketed all-reduce (sum) of every gradient per optimizer step.

A looped model reuses its core weights a different number of times in every step (and on every rank), so nothing
here assumes a static graph: autograd accumulates all uses of a weight into its .grad, and the reducer only reads
.grad once the backward of the step's last micro-batch has produced it. The default is to reduce everything after
the last backward (:meth:`GradReducer.reduce`). Optionally (:meth:`overlap_next_backward`, called just before the
last micro-batch's backward) a bucket is launched as soon as all of its gradients are final (torch's
post-accumulate-grad hook fires once per parameter per backward, after every use has been summed); buckets are
launched strictly in bucket order, so every rank issues the same collectives in the same order whatever order its
own graph finished them in. The sum (not the mean) is taken: the trainer divides each rank's loss by the global
token count, so the sum over ranks is the gradient of the global token mean.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

DEFAULT_BUCKET_MB = 25.0


@dataclass
class _Bucket:
    params: list[torch.Tensor]
    dtype: torch.dtype
    numel: int
    pending: int = 0
    ready: bool = False
    work: object = None
    flat: torch.Tensor | None = None
    members: set = field(default_factory=set)


def _make_buckets(params: list[torch.Tensor], bucket_bytes: float) -> list[_Bucket]:
    """Group parameters (in reverse model order, the order backward tends to finish them) into buckets of at most
    bucket_bytes each, one dtype per bucket."""
    buckets: list[_Bucket] = []
    current: list[torch.Tensor] = []
    size = 0.0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        if current and (size + nbytes > bucket_bytes or p.dtype != current[0].dtype):
            buckets.append(_Bucket(current, current[0].dtype, sum(q.numel() for q in current)))
            current, size = [], 0.0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(_Bucket(current, current[0].dtype, sum(q.numel() for q in current)))
    for b in buckets:
        b.members = {id(p) for p in b.params}
    return buckets


class GradReducer:
    """Sum the gradients of `params` over the data-parallel group (None group: nothing to do).

    A gradient missing on a rank (parameter unused in its micro-batches) counts as zero and is created, so the
    collectives match across ranks."""

    def __init__(self, params, group, bucket_mb: float = DEFAULT_BUCKET_MB):
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.buckets = _make_buckets(self.params, bucket_mb * 2**20)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._armed = False
        self._next_launch = 0
        self.launched_in_backward = 0  # buckets of the last step launched while the backward was still running
        self._hooks = []
        if group is not None:
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]

    # ---- overlap --------------------------------------------------------------------------------------------
    def overlap_next_backward(self) -> None:
        """Launch buckets during the coming backward as their gradients become final. Call it just before the
        backward of the step's LAST micro-batch (earlier gradients would still change)."""
        if self.group is None:
            return
        self._reset()
        self._armed = True
        self.launched_in_backward = 0
        for b in self.buckets:
            b.pending = len(b.params)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._armed:
            return
        bucket = self._bucket_of[id(param)]
        if bucket.work is not None:
            raise RuntimeError("a gradient changed after its bucket was reduced: overlap_next_backward() must be "
                               "called only before the step's last backward")
        bucket.pending -= 1
        if bucket.pending == 0:
            bucket.ready = True
            self._launch_ready_in_order()

    def _launch_ready_in_order(self) -> None:
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].ready:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1
            self.launched_in_backward += 1

    # ---- reduction ------------------------------------------------------------------------------------------
    def _launch(self, bucket: _Bucket) -> None:
        grads = []
        for p in bucket.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad.reshape(-1))
        bucket.flat = torch.cat(grads)
        bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)

    @torch.no_grad()
    def reduce(self) -> None:
        """Finish the step's reduction: launch every bucket not yet launched (in bucket order), wait for all, and
        write the sums back into .grad."""
        if self.group is None:
            return
        for index in range(self._next_launch, len(self.buckets)):
            self._launch(self.buckets[index])
        for bucket in self.buckets:
            bucket.work.wait()
            offset = 0
            for p in bucket.params:
                p.grad.copy_(bucket.flat[offset:offset + p.numel()].view_as(p.grad))
                offset += p.numel()
        self._reset()

    def _reset(self) -> None:
        self._armed = False
        self._next_launch = 0
        for b in self.buckets:
            b.pending, b.ready, b.work, b.flat = 0, False, None, None

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
