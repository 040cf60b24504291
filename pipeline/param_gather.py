"""The ZeRO-1 parameter all-gather after the optimizer step, in buckets, optionally overlapped with the next forward.

After the step each rank holds the new values of its own chunk of the flat parameter vectors; the all-gather brings
every rank the others'. It runs over the same column ranges as the gradient buckets ([dp, width] pieces of the
[dp, chunk_len] view: every rank's collective has the same size), one collective per bucket, in bucket order.

Without overlap (:meth:`ParamGather.run`) every bucket is gathered and applied before the step returns. With
overlap (Megatron's overlap_param_gather) :meth:`ParamGather.start` launches the first `max_in_flight` buckets
asynchronously and returns; the rest are launched, in order, as earlier ones are waited on. A forward pre-hook on
every module that holds parameters (:meth:`ParamGather.attach`) waits, just before the module runs, for the buckets
holding its parameters (its submodules' too: a module may read a child's weight without calling the child), and
for every bucket before them, so the forward of the first modules runs while the later buckets are on the wire.
:meth:`ParamGather.finish` waits for everything left; the runtime calls it where parameters are read outside a
forward or where other data-parallel collectives follow (the first backward, evaluation, checkpoint saves, the next
optimizer step), so every rank issues the same collectives in the same order.

The values are those of the synchronous path bit for bit: the same collectives on the same data, only waited on
later. In fp32 the new parameters travel; with bf16 updates (`old` given) each bucket carries its bf16 update
(new - old), which every rank, the owner included, adds to the old values (see pipeline/optimizer_parts.py).
`poison` (tests): the values other ranks own are set to NaN before their gather, so a read before the wait shows.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeline.grad_buffer import FlatGroup, GradBuffer


@dataclass
class _Range:
    group: FlatGroup
    index: int  # of the group in the buffer
    lo: int
    hi: int
    work: object = None
    received: torch.Tensor | None = None  # the gathered [dp, width] columns (None: gathered in place)


def _ranges(buffer: GradBuffer, width_of) -> list[_Range]:
    return [_Range(g, i, lo, min(lo + width_of(g), g.chunk_len))
            for i, g in enumerate(buffer.groups) for lo in range(0, g.chunk_len, width_of(g))]


def _param_ranges(ranges: list[_Range]) -> dict[int, list[int]]:
    """id(parameter) -> indices of the ranges holding any of its elements."""
    out: dict[int, list[int]] = {}
    for k, r in enumerate(ranges):
        g = r.group
        for p, off in zip(g.params, g.offsets):
            if any(off < c * g.chunk_len + r.hi and off + p.numel() > c * g.chunk_len + r.lo for c in range(g.dp)):
                out.setdefault(id(p), []).append(k)
    return out


class ParamGather:
    """All-gather of the buffer's chunks over `group` in column ranges of width_of(group) (see the module
    docstring). The ranges are launched in order; at most `max_in_flight` are unfinished at a time."""

    def __init__(self, buffer: GradBuffer, group, width_of, max_in_flight: int = 2):
        self.buffer, self.group, self.max_in_flight = buffer, group, max_in_flight
        self.ranges = _ranges(buffer, width_of)
        self._of_param = _param_ranges(self.ranges)
        self.order = list(range(len(self.ranges)))  # launch order (attach: by first use in the forward)
        self._old: list[torch.Tensor] | None = None
        self._next_launch = self._next_finish = len(self.ranges)  # nothing pending
        self._hooks = []
        self.poison = False
        self.busy_s = 0.0  # seconds this process spent inside the gather's calls, launching and waiting

    # ---- the step's gather ----------------------------------------------------------------------------------
    @property
    def pending(self) -> bool:
        return self._next_finish < len(self.ranges)

    @torch.no_grad()
    def start(self, old: list[torch.Tensor] | None = None) -> None:
        """Launch the first buckets of the gather of the chunks just updated (old: the chunks before the update,
        per dtype group, for bf16 updates). The rest follow in wait_for / finish."""
        self.finish()  # a previous gather never overlaps this one
        t0 = time.perf_counter()
        self._old = old
        self._next_launch = self._next_finish = 0
        if self.poison and old is None:
            for g in self.buffer.groups:
                view = g.param_flat.view(g.dp, g.chunk_len)
                view[:self.buffer.rank] = float("nan")
                view[self.buffer.rank + 1:] = float("nan")
        while self._next_launch < min(self.max_in_flight, len(self.ranges)):
            self._launch_next()
        self.busy_s += time.perf_counter() - t0

    @torch.no_grad()
    def run(self, old: list[torch.Tensor] | None = None) -> None:
        """The whole gather now (no overlap)."""
        self.start(old)
        self.finish()

    @torch.no_grad()
    def wait_for(self, last: int) -> None:
        """Finish the ranges up to and including position `last` of the launch order, launching as needed."""
        if last < self._next_finish:
            return
        t0 = time.perf_counter()
        while self._next_finish <= last:
            while self._next_launch <= last and self._next_launch - self._next_finish < self.max_in_flight:
                self._launch_next()
            self._finish_next()
        while self._next_launch < len(self.ranges) and self._next_launch - self._next_finish < self.max_in_flight:
            self._launch_next()  # keep the next buckets on the wire while the forward runs
        self.busy_s += time.perf_counter() - t0

    def finish(self) -> None:
        """Wait for the whole gather (nothing happens when none is pending)."""
        self.wait_for(len(self.ranges) - 1)
        self._old = None

    def _launch_next(self) -> None:
        r = self.ranges[self.order[self._next_launch]]
        self._next_launch += 1
        g, rank = r.group, self.buffer.rank
        params = g.param_flat.view(g.dp, g.chunk_len)
        mine = params[rank, r.lo:r.hi]
        if self._old is not None:
            old = self._old[r.index][r.lo:r.hi]
            delta = (mine - old).to(torch.bfloat16)
            mine.copy_(old)  # every rank, the owner too, adds the same bf16 delta to the same old values
            r.received = torch.empty((g.dp, r.hi - r.lo), dtype=torch.bfloat16, device=mine.device)
            r.work = dist.all_gather_single(r.received.view(-1), delta, group=self.group, async_op=True)
        elif r.hi - r.lo == g.chunk_len:  # one range holds the whole chunk: in place
            r.work = dist.all_gather_single(g.param_flat, mine, group=self.group, async_op=True)
        else:
            r.received = torch.empty((g.dp, r.hi - r.lo), dtype=mine.dtype, device=mine.device)
            r.work = dist.all_gather_single(r.received.view(-1), mine, group=self.group, async_op=True)

    def _finish_next(self) -> None:
        r = self.ranges[self.order[self._next_finish]]
        self._next_finish += 1
        r.work.wait()
        r.work = None
        if r.received is None:
            return
        columns = r.group.param_flat.view(r.group.dp, r.group.chunk_len)[:, r.lo:r.hi]
        if self._old is not None:
            columns.add_(r.received)
        else:
            columns.copy_(r.received)
        r.received = None

    # ---- waits in the forward -------------------------------------------------------------------------------
    def attach(self, model: torch.nn.Module) -> None:
        """Forward pre-hooks on the modules of `model` that hold parameters of the buffer (the root: its own
        parameters only, or the first module call would wait for everything), and the launch order: the ranges
        in the order the modules (in model.modules() order, the forward's for the models here) first need them,
        so a module waits only for the ranges before its own in that order. Every rank computes the same order."""
        self.detach()
        needs = []
        for module in model.modules():
            params = module.parameters(recurse=module is not model)
            mine = sorted({k for p in params for k in self._of_param.get(id(p), [])})
            if mine:
                needs.append((module, mine))
        first_use = list(dict.fromkeys(k for _, mine in needs for k in mine))
        self.order = first_use + [k for k in range(len(self.ranges)) if k not in set(first_use)]
        position = {k: i for i, k in enumerate(self.order)}
        for module, mine in needs:
            self._hooks.append(module.register_forward_pre_hook(self._hook(max(position[k] for k in mine))))

    def _hook(self, last: int):
        @torch.compiler.disable
        def wait(module, args):
            if self._next_finish <= last:
                self.wait_for(last)
        return wait

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
