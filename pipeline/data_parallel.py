"""Data-parallel gradient reduction over a :class:`~pipeline.grad_buffer.GradBuffer`, once per optimizer step.

Two modes, chosen by the buffer's chunking:

- all-reduce (the buffer has one chunk: ZeRO stage 0, or no sharded optimizer built yet): every rank ends with the
  summed gradient of every parameter, reduced in place in the buffer (no concatenation, no copy back);
- reduce-scatter (dp chunks, ZeRO-1): rank r ends with the summed gradient of its own chunk only, which is all
  that its optimizer updates; the rest of its buffer still holds its local gradients until zero_grad.

`wire_dtype` bf16 sends a bf16 copy of the gradients: in all-reduce mode the sum is taken in bf16 by the
collective; in reduce-scatter mode each rank receives every rank's bf16 piece of its chunk (one all-to-all, the
same bytes as a ring reduce-scatter) and adds them up in the gradient's own dtype, in rank order.

Buckets are column ranges of the [dp, chunk_len] view of a group of the buffer, so every bucket is a collective of
the same size on every rank, taken group after group: first the main groups, whose columns follow the order in
which backward completes the gradients (pipeline/grad_buffer.py), so the first columns are final first; then the
groups of the embedding lookups, whose gradients are final only at the end of backward. A looped model reuses its
core weights a different number of times in every step (and on every rank), so nothing assumes a static graph:
autograd sums every use of a weight into its .grad, and a bucket is reduced once the step's last backward has
produced all of its gradients. By default everything is reduced after that backward (:meth:`BufferReducer.reduce`);
with :meth:`overlap_next_backward`, called just before the last micro-batch's backward, a bucket is launched as soon
as all of its parameters' post-accumulate-grad hooks have fired (once per parameter per backward, after every use is
summed), strictly in bucket order, so every rank issues the same collectives in the same order whatever order its
own graph finished them in. A parameter that got no gradient in that backward simply leaves its bucket to
:meth:`reduce`. :attr:`BufferReducer.last_overlap` says how many gradient bytes the last reduction launched while
backward still had gradients to finish. The sum (not the mean) is taken: the trainer divides each rank's loss by
the global token count, so the sum over ranks is the gradient of the global token mean.

Bucket size: `bucket_elements` over all chunks, by default max(40M, 1M x dp) elements (:func:`default_bucket_elements`):
fixed-size buckets would make the per-rank piece of each collective shrink as 1/dp until the calls are
latency-bound. At most `max_in_flight` launched buckets are unfinished at a time (:data:`MAX_IN_FLIGHT`): a bucket
spanning several column ranges is copied for its collective, and that copy lives until the collective is waited
on, so without a bound the buckets launched during the last backward would hold up to a whole gradient more. The
memory planner counts these copies (megaloop/plan/static.py uses the same functions).

:meth:`BufferReducer.reduce` first checks that every parameter's .grad is still the view of the buffer it was
given (one data_ptr comparison per parameter): a .grad replaced by another tensor (set to None and re-created by
autograd, or assigned) would leave the buffer, and so the reduction, without that parameter's gradient.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pipeline.grad_buffer import FlatGroup, GradBuffer

MIN_BUCKET_ELEMENTS = 40_000_000  # elements per bucket at small dp
BUCKET_ELEMENTS_PER_RANK = 1_000_000  # ... and per data-parallel rank at large dp
MAX_IN_FLIGHT = 2  # launched, unfinished buckets at most (each may hold a copy of its columns)
WIRE_DTYPES = {"fp32": None, "bf16": torch.bfloat16}  # None: the gradient's own dtype


@dataclass
class _Bucket:
    group: FlatGroup
    lo: int  # column range [lo, hi) of every chunk
    hi: int
    members: set = field(default_factory=set)  # ids of the parameters with elements in the bucket
    pending: int = 0
    ready: bool = False
    work: object = None
    wire: torch.Tensor | None = None  # the bf16 copy and what came back (bf16 wire only)


def _columns(group: FlatGroup, index: int) -> list[tuple[int, int]]:
    """Column ranges (within a chunk) covered by parameter `index`, one per chunk it touches."""
    off, n, length = group.offsets[index], group.numels[index], group.chunk_len
    return [(max(off, r * length) - r * length, min(off + n, (r + 1) * length) - r * length)
            for r in range(off // length, (off + n - 1) // length + 1)]


def default_bucket_elements(dp: int) -> int:
    """Elements per bucket over all chunks: max(40M, 1M x dp), so each rank's piece stays >= 1M elements."""
    return max(MIN_BUCKET_ELEMENTS, BUCKET_ELEMENTS_PER_RANK * dp)


def bucket_columns(chunk_len: int, dp: int, bucket_elements: int) -> int:
    """Columns per bucket of a group chunked dp ways: about bucket_elements over all chunks (at most chunk_len)."""
    return max(1, min(chunk_len, bucket_elements // dp))


def bucket_count(chunk_len: int, dp: int, bucket_elements: int) -> int:
    """Buckets (collectives per reduction) of one dtype group."""
    return -(-chunk_len // bucket_columns(chunk_len, dp, bucket_elements))


def column_width(group: FlatGroup, bucket_elements: int) -> int:
    """Columns per bucket of `group`."""
    return bucket_columns(group.chunk_len, group.dp, bucket_elements)


def bucket_members(group, bucket_elements: int) -> list[tuple[int, int, set[int]]]:
    """(lo, hi, indices of the group's parameters with elements in columns [lo, hi)) of every bucket of a group
    (a FlatGroup or a planner's GroupLayout: offsets, numels, chunk_len, dp), in column order."""
    width = column_width(group, bucket_elements)
    out = [(lo, min(lo + width, group.chunk_len), set()) for lo in range(0, group.chunk_len, width)]
    for index in range(len(group.offsets)):
        if group.numels[index] == 0:
            continue
        for a, b in _columns(group, index):
            for k in range(a // width, (b - 1) // width + 1):
                out[k][2].add(index)
    return out


def make_buckets(buffer: GradBuffer, bucket_elements: int) -> list[_Bucket]:
    """Column-range buckets of about bucket_elements each (over all chunks), group after group."""
    return [_Bucket(group, lo, hi, {id(group.params[i]) for i in members})
            for group in buffer.groups for lo, hi, members in bucket_members(group, bucket_elements)]


@dataclass(frozen=True)
class OverlapStats:
    """The last reduction's gradient bytes (over all chunks) and how many of them were launched while backward
    still had gradients to finish (before the last post-accumulate-grad hook of that backward)."""

    total_bytes: int = 0
    early_bytes: int = 0

    @property
    def early_fraction(self) -> float:
        return self.early_bytes / self.total_bytes if self.total_bytes else 0.0


class BufferReducer:
    """Sum the buffer's gradients over `group` (None: nothing to do) in buckets; see the module docstring."""

    def __init__(self, buffer: GradBuffer, group, bucket_elements: int | None = None, wire: str = "fp32",
                 max_in_flight: int = MAX_IN_FLIGHT):
        if wire not in WIRE_DTYPES:
            raise ValueError(f"gradient reduction dtype {wire!r}: use one of {sorted(WIRE_DTYPES)}")
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight={max_in_flight}: at least one bucket must be in flight")
        self.buffer, self.group = buffer, group
        self.wire_dtype = WIRE_DTYPES[wire]
        self.scatter = buffer.dp > 1
        dp = group.size() if group is not None else 1
        self.bucket_elements = bucket_elements or default_bucket_elements(dp)
        self.max_in_flight = max_in_flight
        self.buckets = make_buckets(buffer, self.bucket_elements)
        self._grad_views = [(name, p, g.grad_flat[off:off + p.numel()].data_ptr())
                            for g in buffer.groups for name, p, off in zip(g.names, g.params, g.offsets)]
        self._buckets_of: dict[int, list[_Bucket]] = {}
        for b in self.buckets:
            for pid in b.members:
                self._buckets_of.setdefault(pid, []).append(b)
        self._armed = False
        self._next_launch = 0
        self._next_finish = 0  # buckets before it are finished (launched ones from it to _next_launch are not)
        self.launched_in_backward = 0  # buckets of the last step launched while the backward was still running
        self.last_overlap = OverlapStats()  # of the last reduce()
        self._fired = 0  # post-accumulate-grad hooks fired in the armed backward
        self._marks: list[tuple[_Bucket, int]] = []  # (bucket, hooks fired when it was launched) in that backward
        self._hooks = []
        if group is not None:
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in buffer.params]

    def bucket_width(self, group: FlatGroup) -> int:
        """Columns per bucket of a dtype group (its all-gather uses the same ranges)."""
        return column_width(group, self.bucket_elements)

    # ---- overlap --------------------------------------------------------------------------------------------
    def overlap_next_backward(self) -> None:
        """Launch buckets during the coming backward as their gradients become final. Call it just before the
        backward of the step's LAST micro-batch (earlier gradients would still change)."""
        if self.group is None:
            return
        self._reset()
        self._armed = True
        self.launched_in_backward = 0
        self._fired, self._marks = 0, []
        for b in self.buckets:
            b.pending = len(b.members)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        if not self._armed:
            return
        self._fired += 1
        for bucket in self._buckets_of[id(param)]:
            if bucket.work is not None:
                raise RuntimeError("a gradient changed after its bucket was reduced: overlap_next_backward() "
                                   "must be called only before the step's last backward")
            bucket.pending -= 1
            bucket.ready = bucket.pending == 0
        self._launch_ready_in_order()

    def _launch_ready_in_order(self) -> None:
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].ready:
            if self._next_launch - self._next_finish >= self.max_in_flight:  # bound the copies alive
                self._finish(self.buckets[self._next_finish])
                self._next_finish += 1
            self._launch(self.buckets[self._next_launch])
            self._marks.append((self.buckets[self._next_launch], self._fired))
            self._next_launch += 1
            self.launched_in_backward += 1

    # ---- reduction ------------------------------------------------------------------------------------------
    def _launch(self, bucket: _Bucket) -> None:
        g = bucket.group
        grads = g.grad_flat.view(g.dp, g.chunk_len)[:, bucket.lo:bucket.hi]
        mine = grads[self.buffer.rank]
        if not self.scatter:  # one chunk: all-reduce in place (or a bf16 copy)
            if self.wire_dtype is None:
                bucket.work = dist.all_reduce(mine, group=self.group, async_op=True)
            else:
                bucket.wire = mine.to(self.wire_dtype)
                bucket.work = dist.all_reduce(bucket.wire, group=self.group, async_op=True)
        elif self.wire_dtype is None:
            bucket.work = dist.reduce_scatter_single(mine, grads.contiguous().view(-1), group=self.group,
                                                     async_op=True)
        else:
            send = grads.to(self.wire_dtype)
            bucket.wire = torch.empty_like(send)
            bucket.work = dist.all_to_all_single(bucket.wire, send, group=self.group, async_op=True)

    def _finish(self, bucket: _Bucket) -> None:
        bucket.work.wait()
        bucket.work = None
        if bucket.wire is None:
            return
        g = bucket.group
        mine = g.grad_flat.view(g.dp, g.chunk_len)[self.buffer.rank, bucket.lo:bucket.hi]
        received = bucket.wire.to(mine.dtype)
        mine.copy_(received if not self.scatter else received.sum(dim=0))
        bucket.wire = None

    @torch.no_grad()
    def reduce(self) -> None:
        """Finish the step's reduction: wait for the buckets launched during the backward, then reduce the others
        one at a time in bucket order (so that at most one bucket's wire copy is alive: a bucket spanning several
        column ranges is copied to a contiguous [dp, width] tensor for the collective)."""
        self.check_grad_views()  # also without a group: the optimizer and the clip read the buffer
        if self.group is None:
            return
        for bucket in self.buckets[self._next_finish:self._next_launch]:
            self._finish(bucket)
        for bucket in self.buckets[self._next_launch:]:
            self._launch(bucket)
            self._finish(bucket)
        self.last_overlap = OverlapStats(sum(self.bucket_bytes(b) for b in self.buckets),
                                         sum(self.bucket_bytes(b) for b, fired in self._marks if fired < self._fired))
        self._marks = []
        self._reset()

    def bucket_bytes(self, bucket: _Bucket) -> int:
        """Gradient bytes of a bucket over all chunks (its columns of every chunk)."""
        g = bucket.group
        return (bucket.hi - bucket.lo) * g.dp * g.grad_flat.element_size()

    def check_grad_views(self) -> None:
        """Raise if a parameter's .grad is no longer its view of the buffer (one data_ptr check each)."""
        for name, p, ptr in self._grad_views:
            if p.grad is None or p.grad.data_ptr() != ptr:
                what = "is None" if p.grad is None else "is a tensor outside the gradient buffer"
                raise RuntimeError(f"parameter {name!r}: its .grad {what}, so the data-parallel reduction would "
                                   "miss its gradient; zero gradients with optimizer.zero_grad() (in place) and "
                                   "never assign or set .grad to None")

    def _reset(self) -> None:
        self._armed = False
        self._next_launch = 0
        self._next_finish = 0
        for b in self.buckets:
            b.pending, b.ready, b.work, b.wire = 0, False, None, None

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
