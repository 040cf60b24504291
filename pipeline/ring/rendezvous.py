"""NCCL's point-to-point semantics on gloo, so that CPU runs see the hangs a GPU job would.

Two things NCCL does and gloo does not decide whether a pipeline's point-to-point traffic can hang:

- a send completes only when the peer receives it (once the message outgrows what NCCL buffers: NCCL_BUFFSIZE,
  4 MiB by default, is the most a send can leave behind before its receive is posted); a gloo isend returns
  and the sender moves on;
- `batch_isend_irecv` over one communicator returns one Work covering its sends and receives, and a
  communicator's operations run in order on one stream: a later batch does not start before the earlier completed.

`RendezvousP2P` is a drop-in for `dist.batch_isend_irecv` on gloo groups that adds both. Each group gets one worker
thread, its "stream", which runs the group's batches one at a time in posting order; the batch's single Work
completes when all of its operations did, and a send of more than `eager_bytes` completes only when its receiver
acknowledges the payload (a one-byte message back on the same group, tag `ACK_TAG`, so it never matches a payload
receive). The caller's thread plays the compute stream: a Work.wait() that under NCCL makes the compute stream wait
on the communicator's stream here blocks the caller until the worker finished the batch. A worker thread and an
acknowledgement are the least that gives both properties without touching gloo: the thread gives the per-
communicator order (a batch stuck on its send holds up every later batch of its group, as an NCCL stream does), the
acknowledgement ties a send's completion to the matching receive's.

`eager_bytes` is 0 by default: every send waits for its receive. NCCL completes small sends eagerly, but a schedule
that relies on it breaks when the model grows, so the CPU check is the strictest one. Errors (gloo's timeout on a
receive or an acknowledgement that never comes) end the batch's Work with the error, and every later batch of that
group fails with it, as an aborted communicator does.
"""
from __future__ import annotations

import datetime
import queue
import threading
from typing import Optional, Sequence

import torch
import torch.distributed as dist

ACK_TAG = 0x5244  # acknowledgements travel under their own tag, never matched by a payload's receive
EAGER_BYTES = 0  # sends of at most this many bytes complete without waiting for their receive (NCCL: its buffers)


class BatchWork:
    """The one Work of an emulated batch: done when every operation of the batch completed (or failed)."""

    def __init__(self):
        self._done = threading.Event()
        self._error: Optional[BaseException] = None

    def wait(self, timeout=None) -> bool:
        self._done.wait()
        if self._error is not None:
            raise RuntimeError(f"point-to-point batch failed under rendezvous semantics: {self._error}") \
                from self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def _finish(self, error: Optional[BaseException] = None) -> None:
        self._error = error
        self._done.set()


class _Stream:
    """One group's worker thread: runs its batches in posting order, one at a time."""

    def __init__(self, eager_bytes: int, timeout: datetime.timedelta):
        self.eager_bytes, self.timeout = eager_bytes, timeout
        self.batches: queue.Queue = queue.Queue()
        self.failed: Optional[BaseException] = None
        self.eager: list = []  # gloo works of eager sends still in flight (they hold their tensors)
        self.thread = threading.Thread(target=self._run, name="rendezvous-p2p", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            item = self.batches.get()
            if item is None:
                return
            ops, work = item
            if self.failed is None:
                try:
                    self.eager = [w for w in self.eager if not w.is_completed()]
                    self.eager += _execute(ops, self.eager_bytes, self.timeout)
                except Exception as err:  # noqa: BLE001  (handed to whoever waits on the batch)
                    self.failed = err
            work._finish(self.failed)


def _execute(ops: Sequence[dist.P2POp], eager_bytes: int, timeout: datetime.timedelta) -> list:
    """Runs one batch: every payload and acknowledgement receive posted together; each receive acknowledged as soon
    as it completed (a batch may hold several messages of one channel, which its sender may send one batch at a
    time); the batch done when its sends are acknowledged. gloo gives one work per operation, and each is waited for
    once (a second wait would wait for another message), with `timeout` (a gloo wait has none of its own). A send
    of at most `eager_bytes` is not waited for (a gloo send itself waits for its receive to be posted): its work is
    returned, to be kept until it completes."""
    def large(op):
        return op.tensor.numel() * op.tensor.element_size() > eager_bytes

    acks = [dist.P2POp(dist.irecv, torch.empty(1, dtype=torch.uint8), op.peer, op.group, ACK_TAG)
            for op in ops if op.op is dist.isend and large(op)]
    works = dist.batch_isend_irecv(list(ops) + acks)
    pending, eager = works[len(ops):], []
    for work, op in zip(works, ops):
        if op.op is dist.isend:
            (pending if large(op) else eager).append(work)
            continue
        work.wait(timeout)
        if large(op):
            pending.append(dist.isend(torch.ones(1, dtype=torch.uint8), op.peer, op.group, ACK_TAG))
    for work in pending:
        work.wait(timeout)
    return eager


class RendezvousP2P:
    """`dist.batch_isend_irecv` with NCCL's semantics on gloo (see the module docstring): returns one Work per
    batch. An operation not done within `timeout_s` fails its batch (the error names the timeout). `close()` ends
    the worker threads (they hold no group between batches)."""

    def __init__(self, eager_bytes: int = EAGER_BYTES, timeout_s: float = 600.0):
        if eager_bytes < 0 or not timeout_s > 0:
            raise ValueError(f"need eager_bytes >= 0 and timeout_s > 0, got {eager_bytes} and {timeout_s}")
        self.eager_bytes, self.timeout = eager_bytes, datetime.timedelta(seconds=timeout_s)
        self._streams: dict[int, _Stream] = {}  # id(group) -> its stream; the ops carry the group itself

    def __call__(self, ops: Sequence[dist.P2POp]) -> list[BatchWork]:
        if not ops:
            return []
        groups = {id(op.group) for op in ops}
        if len(groups) != 1:
            raise ValueError("all operations of a batch_isend_irecv must use the same group")
        stream = self._streams.get(groups.pop())
        if stream is None:
            stream = self._streams[id(ops[0].group)] = _Stream(self.eager_bytes, self.timeout)
        work = BatchWork()
        stream.batches.put((list(ops), work))
        return [work]

    def close(self) -> None:
        for stream in self._streams.values():
            stream.batches.put(None)
        for stream in self._streams.values():
            stream.thread.join()
        self._streams.clear()
