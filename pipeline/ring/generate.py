"""The ring schedule: per-rank action lists for one optimizer step of looped micro-batches.

Every micro-batch is one chain of compute actions (see `actions`); the generator interleaves the chains of many
micro-batches on the ring by list scheduling against a cost model: whenever a rank could start something, it
starts one of the actions whose inputs are there, chosen by a rule:

- critical-path: the one whose chain has the longest remaining time, so the micro-batches finish together instead
  of one straggler at the end;
- in-flight-first: while micro-batches still wait to enter, those in flight first (longest remaining chain
  first), then the no-autograd lap of the open micro-batch closest to its first lap with autograd; critical-path
  once all have entered (no-autograd laps are kept as fill for the gaps between the laps in flight).

Two bounds hold memory:

- in flight: a micro-batch stores lap activations from its first lap with autograd (rank 0 first) until its last
  backward (rank 0 last); it starts that lap only while fewer than `max_in_flight` are in flight, so no rank ever
  holds more than `max_in_flight` micro-batches' lap activations;
- open: from its Embed to its EmbedBackward rank 0 keeps a micro-batch's e and prelude activations; micro-batches
  enter (Embed) only while fewer than the open cap are open.

The generator plans with both rules, micro-batches entering longest first or in the given order, and the open cap
at `max_in_flight` or `max_open`, and keeps the plan with the shortest makespan (each plan is a few milliseconds).
A micro-batch's no-autograd laps store nothing besides e, so open micro-batches waiting for their turn in flight
are cheap fill between the others' laps.

Because the orders come from a feasible timed run and Sends are asynchronous, the action lists cannot deadlock
(the simulator checks it anyway). With laps = grad_laps = v for every micro-batch the ring is interleaved 1F1B's
setting with v shared chunks, whose bubble of (p - 1)(f + b) per rank is also the least any ring schedule can have
(rank p-1 cannot start before p-1 forward segments and must end p-1 backward segments before the last rank 0
action); how close the plans come under a given memory bound is what benchmarks/ring_schedule.py measures.
"""
from __future__ import annotations

import operator
from typing import Sequence

from pipeline.ring.actions import Action, Compute, MicroBatch, ScheduleError, chain, rank_of
from pipeline.ring.costs import CostModel
from pipeline.ring.p2p import with_p2p


def ring_schedule(specs: Sequence[MicroBatch], pp: int, max_in_flight: int, max_open: int | None = None,
                  costs: CostModel = CostModel()) -> list[list[Action]]:
    """Per-rank action lists (Sends and Recvs included) for the micro-batches `specs` on a ring of `pp` ranks:
    at most `max_in_flight` micro-batches hold lap activations on any rank, at most `max_open` (default
    2 * max_in_flight) are between their Embed and EmbedBackward."""
    return with_p2p(ring_orders(specs, pp, max_in_flight, max_open, costs), specs)


def ring_orders(specs: Sequence[MicroBatch], pp: int, max_in_flight: int, max_open: int | None = None,
                costs: CostModel = CostModel()) -> list[list[Compute]]:
    """The per-rank orders of compute actions (see `ring_schedule`)."""
    pp, max_in_flight = operator.index(pp), operator.index(max_in_flight)
    max_open = 2 * max_in_flight if max_open is None else operator.index(max_open)
    if pp < 1 or not 1 <= max_in_flight <= max_open:
        raise ScheduleError(f"need pp >= 1 and 1 <= max_in_flight <= max_open, got pp={pp}, "
                            f"max_in_flight={max_in_flight}, max_open={max_open}")
    specs = list(specs)
    plans = [_ListScheduler(specs, pp, max_in_flight, cap, costs, rule, longest_first).run()
             for rule in RULES for longest_first in (True, False) for cap in sorted({max_in_flight, max_open})]
    return min(plans, key=lambda plan: plan[0])[1]


RULES = ("critical-path", "in-flight-first")


class _ListScheduler:
    def __init__(self, specs: list[MicroBatch], pp: int, max_in_flight: int, max_open: int, costs: CostModel,
                 rule: str, longest_first: bool):
        self.pp, self.max_in_flight, self.max_open, self.costs = pp, max_in_flight, max_open, costs
        self.rule = rule
        self.chains = [chain(mb, spec, pp) for mb, spec in enumerate(specs)]
        self.durations = [[costs.of(a, specs) for a in actions] for actions in self.chains]
        self.tails = [self._tail(mb) for mb in range(len(specs))]
        self.waiting = list(range(len(specs)))
        if longest_first:
            self.waiting.sort(key=lambda mb: (-self.tails[mb][0], mb))
        self.next = [0] * len(specs)
        self.ready = [0.0] * len(specs)
        self.free = [0.0] * pp
        # chain positions of a micro-batch's first Forward with autograd and of its last Backward (rank 0)
        self.enter = [1 + pp * spec.first_grad_lap for spec in specs]
        self.leave = [len(actions) - 2 for actions in self.chains]
        self.open: set[int] = set()
        self.in_flight: set[int] = set()
        self.orders: list[list[Compute]] = [[] for _ in range(pp)]

    def _tail(self, mb: int) -> list[float]:
        """tail[i]: the time from the start of action i of the chain to the chain's end (latencies included)."""
        actions, durations = self.chains[mb], self.durations[mb]
        tail = [0.0] * (len(actions) + 1)
        for i in reversed(range(len(actions))):
            hop = 0.0
            if i + 1 < len(actions) and rank_of(actions[i + 1], self.pp) != rank_of(actions[i], self.pp):
                hop = self.costs.latency
            tail[i] = durations[i] + hop + tail[i + 1]
        return tail

    def _candidates(self) -> list[int]:
        full = len(self.in_flight) >= self.max_in_flight
        running = [mb for mb in self.open if not (full and self.next[mb] == self.enter[mb])]
        if self.waiting and len(self.open) < self.max_open:
            running.append(self.waiting[0])
        return running

    def run(self) -> tuple[float, list[list[Compute]]]:
        """(makespan, per-rank orders) of the list schedule."""
        while True:
            candidates = self._candidates()
            if not candidates:
                return max(self.free), self.orders
            by_rank: dict[int, list[int]] = {}
            for mb in candidates:
                by_rank.setdefault(rank_of(self.chains[mb][self.next[mb]], self.pp), []).append(mb)
            start, rank = min((max(self.free[r], min(self.ready[mb] for mb in mbs)), r) for r, mbs in by_rank.items())
            ready = [mb for mb in by_rank[rank] if self.ready[mb] <= start]
            self._place(max(ready, key=self._priority), rank, start)

    def _priority(self, mb: int) -> tuple:
        tail = self.tails[mb][self.next[mb]]
        if self.rule == "critical-path" or not self.waiting:
            return (tail, -mb)
        if mb in self.in_flight:
            return (1, tail, -mb)
        return (0, self.next[mb] - self.enter[mb], -mb)

    def _place(self, mb: int, rank: int, start: float) -> None:
        if self.next[mb] == 0:
            self.waiting.remove(mb)
            self.open.add(mb)
        i = self.next[mb]
        if i == self.enter[mb]:
            self.in_flight.add(mb)
        elif i == self.leave[mb]:
            self.in_flight.discard(mb)
        action, end = self.chains[mb][i], start + self.durations[mb][i]
        self.orders[rank].append(action)
        self.free[rank] = end
        self.next[mb] = i + 1
        if i + 1 == len(self.chains[mb]):
            self.open.discard(mb)
        else:
            hop = self.costs.latency if rank_of(self.chains[mb][i + 1], self.pp) != rank else 0.0
            self.ready[mb] = end + hop
