"""Runs one rank's ring-pipeline action list with torch.distributed point-to-point operations.

`RingExecutor(program, group).run(actions, specs)` executes the list that `pipeline.ring.ring_schedule` (or any
schedule over the same actions) made for this rank, in order:

- Sends and Recvs travel on the pipeline's channels (pipeline.ring.channels): one process group per direction of
  each pair of ring neighbours, which makes the lists deadlock-free under NCCL's rendezvous semantics too (a send
  completes only when its receive does; one communicator's operations run in order), see that module for why. A
  run of consecutive Sends and Recvs posts each channel's Sends as one `batch_isend_irecv` on its group and leaves
  them in flight (their tensors are kept until they complete; nothing waits on them before the run's end), then
  each channel's Recvs, which are waited for before the next compute action. A Recv's buffer has the shape
  `program.message_shape` gives (the state leaving that lap, or its gradient); with `check_messages` every message
  is preceded by a small header (on the message's device) naming it and its shape, received and compared before
  the payload, so a Recv that does not match its channel's next Send (or expects another shape) fails with both
  names. Without it, gloo aborts the process on a size mismatch ("Received data size doesn't match expected
  size") and a swapped message of the same shape goes unnoticed: check new schedules and programs with
  `check_messages=True`. A peer that never sends fails at the process group's timeout instead of hanging; the
  error says which Recv waited. (The earlier posting, every message on the pipeline's one group and a run of Sends
  and Recvs in one batch, hangs under rendezvous semantics; tests/pipeline/shared_posting.py keeps it to show
  that.)
- Forward with grad=False runs under `torch.no_grad` and stores nothing; with grad=True its input is a leaf that
  requires grad (except the state entering a micro-batch's first kept lap, whose gradient truncated backprop drops)
  and input and output are stored until its Backward, which calls `torch.autograd.backward(output, gradient)` and
  hands on the input's gradient; stored tensors are freed as soon as their backward ran.
- Rank 0 keeps e from Embed as a leaf for the kept laps, so its gradient accumulates over them; EmbedBackward
  back-propagates that sum through the embedding and prelude.

`run` returns the per-micro-batch losses (last rank), per-action wall times and when each batch_isend_irecv was
posted and its receives completed (benchmarks/ring_execute.py turns them into a `CostModel` for the simulator) and
the peak stored tensors and autograd-saved bytes of this rank.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from pipeline.ring.actions import (
    Action,
    Backward,
    Compute,
    Embed,
    EmbedBackward,
    Forward,
    Loss,
    LossBackward,
    Message,
    MicroBatch,
    Recv,
    Send,
    label,
)
from pipeline.ring.channels import RingChannels, ring_channels
from pipeline.ring.p2p import neighbours
from pipeline.ring.program import StageProgram
from pipeline.ring.saved import SavedBytes

_KINDS = {Embed: 0, Forward: 1, Loss: 2, LossBackward: 3, Backward: 4, EmbedBackward: 5}


class ExecutionError(RuntimeError):
    """An action list that cannot run on this rank; the message names the rank and the action."""


@dataclass
class ExecResult:
    """What one rank did: losses[mb] (last rank only), timings (action, start, end) of every compute action in
    `time.perf_counter` seconds, recvs (message, posted, arrived) of every Recv, posts (start, posted, done) of
    every `batch_isend_irecv` call (done: its receives completed; posted to done is the time this rank waited),
    peak_stored (most stored tensor groups at once: a kept lap's input and output, the loss's input and value, an
    open micro-batch's e) and peak_saved_bytes (autograd's saved tensors)."""

    losses: dict[int, torch.Tensor] = field(default_factory=dict)
    timings: list[tuple[Compute, float, float]] = field(default_factory=list)
    recvs: list[tuple[Message, float, float]] = field(default_factory=list)
    posts: list[tuple[float, float, float]] = field(default_factory=list)
    peak_stored: int = 0
    peak_saved_bytes: int = 0


_HEADER = 12


def header(message: Message, shape: Sequence[int], device: torch.device | str = "cpu") -> torch.Tensor:
    """The int64 header naming a message: kind, micro-batch, lap, stage (-1 where the action has none), the number
    of dimensions and the shape (up to 7 dimensions, padded with -1), on `device` (the message's: NCCL sends
    device tensors only)."""
    producer = message.producer
    shape = list(shape)
    if len(shape) > _HEADER - 5:
        raise ExecutionError(f"message shapes of at most {_HEADER - 5} dimensions can be checked, got {shape}")
    return torch.tensor([_KINDS[type(producer)], producer.mb, getattr(producer, "lap", -1),
                         getattr(producer, "stage", -1), len(shape)] + shape + [-1] * (_HEADER - 5 - len(shape)),
                        dtype=torch.int64, device=device)


def _describe(head: torch.Tensor) -> str:
    kind, mb, lap, stage, ndim, *shape = head.tolist()
    names = {v: k.__name__ for k, v in _KINDS.items()}
    return f"{names.get(kind, kind)}(mb={mb}, lap={lap}, stage={stage}) of shape {tuple(shape[:ndim])}"


class RingExecutor:
    """Runs ring-pipeline action lists for one rank of a pipeline; messages have `dtype` and live on `device`.
    `channels` (pipeline.ring.channels.ring_channels, made once per job) say where messages travel and this rank's
    ring position; without them they are made here for the pipeline of `group`'s ranks (default: the world), which
    is collective over the world (every rank constructs an executor at the same point) and gives gloo's own
    semantics."""

    def __init__(self, program: StageProgram, group: Optional[dist.ProcessGroup] = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 check_messages: bool = False, channels: Optional[RingChannels] = None):
        self.program, self.dtype, self.device = program, dtype, torch.device(device)
        self.check_messages = check_messages
        if channels is None:
            ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
            if len(ranks) != dist.get_world_size():  # new_group is collective over the world: every pipeline's
                raise ValueError("a RingExecutor on a subgroup needs channels=pipeline.ring.channels.ring_channels("
                                 "<every pipeline's ranks>, rank): creating them is collective over the world")
            channels = ring_channels([ranks], dist.get_rank())
        self.channels = channels
        self.ranks, self.rank = channels.ranks, channels.position
        self.pp = len(self.ranks)

    def run(self, actions: Sequence[Action], specs: Sequence[MicroBatch]) -> ExecResult:
        """Executes this rank's `actions` for the micro-batches `specs` (one optimizer step's forward and backward;
        parameter gradients accumulate in `.grad`)."""
        self.before, _ = neighbours(specs, self.pp)
        self.specs = list(specs)
        self.values: dict[Compute, Optional[torch.Tensor]] = {}
        self.stored: dict[Compute, tuple[torch.Tensor, torch.Tensor]] = {}
        self.embeds: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.sends: list[tuple[list[dist.Work], list[torch.Tensor]]] = []
        self.result, self.saved = ExecResult(), SavedBytes()
        with self.saved.track():
            i = 0
            while i < len(actions):
                j = i
                while j < len(actions) and isinstance(actions[j], (Send, Recv)):
                    j += 1
                if j > i:
                    self._communicate(actions[i:j])
                    i = j
                    continue
                self._compute(actions[i])
                i += 1
            self._finish_sends()
        self.result.peak_saved_bytes = self.saved.peak
        return self.result

    # communication -------------------------------------------------------------------------------------------

    def _communicate(self, batch: Sequence[Action]) -> None:
        """One run of Sends and Recvs: each channel's Sends posted and left in flight, then each channel's Recvs
        posted and waited for (see the module docstring)."""
        sends: dict[int, tuple[list[dist.P2POp], list[torch.Tensor]]] = {}
        for action in batch:
            if isinstance(action, Send):
                ops, kept = sends.setdefault(action.dst, ([], []))
                ops += self._send_ops(action, kept)
        for ops, kept in sends.values():
            self.sends.append((self.channels.post(ops), kept))
        recvs = [action for action in batch if isinstance(action, Recv)]
        if self.check_messages:  # each receive's header checked before its payload
            for action in recvs:
                posted = time.perf_counter()
                self._wait_all(self.channels.post([self._recv_op(action, check=True)]), [action], posted)
                self.result.recvs.append((action.message, posted, time.perf_counter()))
            return
        by_src: dict[int, list[dist.P2POp]] = {}
        for action in recvs:
            by_src.setdefault(action.src, []).append(self._recv_op(action))
        posted = time.perf_counter()
        works = [work for ops in by_src.values() for work in self.channels.post(ops)]
        self._wait_all(works, batch, posted)
        self.result.recvs += [(action.message, posted, time.perf_counter()) for action in recvs]

    def _wait_all(self, works: list, batch: Sequence[Action], start: float) -> None:
        if not works:
            return
        posted = time.perf_counter()
        for work in works:
            self._wait(work, batch)
        self.result.posts.append((start, posted, time.perf_counter()))

    def _send_ops(self, action: Send, kept: list) -> list[dist.P2POp]:
        producer = action.message.producer
        if producer not in self.values:
            raise ExecutionError(f"rank {self.rank}: {label(action)} before {label(producer)} ran on this rank")
        tensor = self.values.pop(producer).contiguous()
        if tensor.dtype != self.dtype:  # the receiver's buffer has self.dtype: the bytes would be misread
            raise ExecutionError(f"rank {self.rank}: {label(action)} sends {tensor.dtype}, but messages are "
                                 f"{self.dtype}: the program's message_dtype and its outputs disagree")
        peer, group = self.ranks[action.dst], self.channels.group(self.rank, action.dst)
        tensors = ([header(action.message, tensor.shape, tensor.device)] if self.check_messages else []) + [tensor]
        kept += tensors
        return [dist.P2POp(dist.isend, t, peer, group) for t in tensors]

    def _recv_op(self, action: Recv, check: bool = False) -> dist.P2POp:
        """The irecv of `action`'s payload; with `check`, first receive its header and compare it."""
        shape = self._shape(action.message)
        peer, group = self.ranks[action.src], self.channels.group(action.src, self.rank)
        if check:
            head = header(action.message, shape, self.device)
            got = torch.empty_like(head)
            self._wait(self.channels.post([dist.P2POp(dist.irecv, got, peer, group)])[0], [action])
            if not torch.equal(got, head):
                raise ExecutionError(f"rank {self.rank}: {label(action)} expects {_describe(head)} but rank "
                                     f"{action.src} sent {_describe(got)}: this rank's Recvs do not follow rank "
                                     f"{action.src}'s Send order, or the program's message_shape disagrees "
                                     f"between ranks; check the schedule with pipeline.ring.simulate")
        buffer = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.values[action.message.producer] = buffer
        return dist.P2POp(dist.irecv, buffer, peer, group)

    def _shape(self, message: Message) -> tuple[int, ...]:
        producer = message.producer
        if isinstance(producer, Forward):
            return tuple(self.program.message_shape(producer.mb, producer.lap))
        if isinstance(producer, Backward) and producer.stage > 0:
            return tuple(self.program.message_shape(producer.mb, producer.lap))
        if isinstance(producer, Backward):
            return tuple(self.program.message_shape(producer.mb, producer.lap - 1))
        raise ExecutionError(f"rank {self.rank}: {label(producer)}'s output never travels between ranks")

    def _wait(self, work, batch) -> None:
        try:
            work.wait()
        except RuntimeError as err:
            names = ", ".join(label(a) for a in batch)
            raise ExecutionError(f"rank {self.rank}: point-to-point batch [{names}] failed ({err}). A Recv whose "
                                 f"shape or order does not match its peer's Send, or a peer that never sends, ends "
                                 f"here (and, under rendezvous semantics, sends that wait for receives their peer "
                                 f"cannot post yet); check the schedule with pipeline.ring.simulate (p2p="
                                 f"\"rendezvous\", or \"shared\" for the shared posting) and the program's "
                                 f"message_shape") from err

    def _finish_sends(self) -> None:
        for works, _ in self.sends:
            for work in works:
                self._wait(work, [])
        self.sends.clear()

    # compute -------------------------------------------------------------------------------------------------

    def _compute(self, action: Action) -> None:
        handler = {Embed: self._embed, Forward: self._forward, Loss: self._loss, LossBackward: self._loss_backward,
                   Backward: self._backward, EmbedBackward: self._embed_backward}.get(type(action))
        if handler is None:
            raise ExecutionError(f"rank {self.rank}: {action!r} is not a ring-schedule action")
        start = time.perf_counter()
        handler(action)
        self.result.timings.append((action, start, time.perf_counter()))
        stored = len(self.stored) + len(self.embeds)
        self.result.peak_stored = max(self.result.peak_stored, stored)
        self._reap_sends()

    def _input(self, action: Compute) -> Optional[torch.Tensor]:
        producer = self.before[action]
        if producer not in self.values:
            raise ExecutionError(f"rank {self.rank}: {label(action)} runs before it has the output of "
                                 f"{label(producer)} (a missing Recv, or an order the schedule does not allow)")
        return self.values.pop(producer)

    def _embed(self, action: Embed) -> None:
        e, h0 = self.program.embed(action.mb)
        self.embeds[action.mb] = (e, e.detach().requires_grad_(e.requires_grad))
        self.values[action] = h0.detach()

    def _forward(self, action: Forward) -> None:
        h = self._input(action)
        e = None
        if action.stage == 0:
            e_graph, e_leaf = self.embeds[action.mb]
            e = e_leaf if action.grad else e_leaf.detach()
        if not action.grad:
            with torch.no_grad():
                self.values[action] = self.program.lap_segment(action.mb, action.lap, h, e)
            return
        first = action.stage == 0 and action.lap == self.specs[action.mb].first_grad_lap
        h = h.detach().requires_grad_(not first)
        out = self.program.lap_segment(action.mb, action.lap, h, e)
        self.stored[action] = (h, out)
        self.values[action] = out.detach()

    def _loss(self, action: Loss) -> None:
        h = self._input(action).detach().requires_grad_(True)
        loss = self.program.loss(action.mb, h)
        self.stored[action] = (h, loss)
        self.result.losses[action.mb] = loss.detach()

    def _loss_backward(self, action: LossBackward) -> None:
        h, loss = self.stored.pop(Loss(action.mb))
        torch.autograd.backward(loss)
        self.values[action] = h.grad

    def _backward(self, action: Backward) -> None:
        grad = self._input(action)
        h, out = self.stored.pop(Forward(action.mb, action.lap, action.stage, True))
        torch.autograd.backward(out, grad)
        self.values[action] = h.grad if h.requires_grad else None

    def _embed_backward(self, action: EmbedBackward) -> None:
        self._input(action)  # the dropped gradient of the state entering the first kept lap
        e, e_leaf = self.embeds.pop(action.mb)
        if e.requires_grad and e_leaf.grad is not None:
            torch.autograd.backward(e, e_leaf.grad)

    def _reap_sends(self) -> None:
        self.sends = [(works, kept) for works, kept in self.sends if not all(w.is_completed() for w in works)]
