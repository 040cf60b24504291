"""One plan of the ring generator: list scheduling of the micro-batches' chains under the memory bounds.

The plan is a timed run against the cost model: repeatedly, the rank that can start something soonest starts one
of the actions whose inputs are there (it never idles while one is), chosen by its rule:

- "critical-path": the action whose chain has the longest remaining time;
- "slack": the action with the earliest latest-start (see `_latest_starts`), so no-autograd laps of micro-batches
  that cannot enter flight for a while wait as fill while the laps in flight go first;
- "slack-coupled": as "slack", but a micro-batch in flight is also due by the time the micro-batch waiting for its
  slot will be ready to enter.

`jitter` > 0 adds a seeded random amount in [0, jitter) to the latest starts, for restarts that explore other ties.

The generator runs in the trainer every optimizer step, so a placement costs little: each rank keeps the open
micro-batches whose next action it runs and when it can start one (updated only for the ranks a placement
touches), a lone ready action is taken without ranking, and latest starts are computed only for the ready
micro-batches, the slot estimate stopping once it has them. `run(beat)` gives a plan up once it cannot end
before `beat` (the best plan so far).
"""
from __future__ import annotations

import heapq
import random
from typing import Sequence

from pipeline.ring.actions import Compute, MicroBatch, chain, rank_of
from pipeline.ring.costs import CostModel

RULES = ("slack-coupled", "slack", "critical-path")
_NEVER = float("inf")


def chain_tail(actions: list[Compute], durations: list[float], pp: int, latency: float) -> list[float]:
    """tail[i]: the time from the start of action i of a chain to the chain's end (latencies included)."""
    ranks = [rank_of(a, pp) for a in actions]
    return _tail(durations, _hops(ranks, latency))


def _hops(ranks: list[int], latency: float) -> list[float]:
    """hop[i]: the latency between chain actions i and i + 1 (none on one rank, or after the last action)."""
    return [latency if here != there else 0.0 for here, there in zip(ranks, ranks[1:])] + [0.0]


def _tail(durations: list[float], hops: list[float]) -> list[float]:
    tail = [0.0] * (len(durations) + 1)
    for i in reversed(range(len(durations))):
        tail[i] = durations[i] + hops[i] + tail[i + 1]
    return tail


class Chains:
    """The micro-batches' chains and what every plan reads of them, computed once per generator call: per action
    its rank, duration and the latency before the next action (`hops`); per chain its `tails` (see `chain_tail`)
    and the positions of its first Forward with autograd (`enter`) and its last Backward (`leave`, rank 0); per
    rank the total `work`, the least time any chain takes before its first action there (`head`) and after its
    last one (`foot`)."""

    def __init__(self, specs: Sequence[MicroBatch], pp: int, costs: CostModel):
        specs = list(specs)
        self.pp = pp
        self.actions = [chain(mb, spec, pp) for mb, spec in enumerate(specs)]
        self.ranks = [[rank_of(a, pp) for a in actions] for actions in self.actions]
        self.durations = [[costs.of(a, specs) for a in actions] for actions in self.actions]
        self.hops = [_hops(ranks, costs.latency) for ranks in self.ranks]
        self.tails = [_tail(d, h) for d, h in zip(self.durations, self.hops)]
        self.enter = [1 + pp * spec.first_grad_lap for spec in specs]
        self.leave = [len(actions) - 2 for actions in self.actions]
        self.work = [0.0] * pp
        self.head, self.foot = [_NEVER] * pp, [_NEVER] * pp
        for ranks, durations, tail in zip(self.ranks, self.durations, self.tails):
            first, last = {}, {}
            for i, (rank, duration) in enumerate(zip(ranks, durations)):
                self.work[rank] += duration
                first.setdefault(rank, i)
                last[rank] = i
            for rank in range(pp):
                self.head[rank] = min(self.head[rank], tail[0] - tail[first[rank]])
                self.foot[rank] = min(self.foot[rank], tail[last[rank]] - durations[last[rank]])


class ListScheduler:
    """Plans once; `run()` returns (makespan, per-rank compute orders), and `positions` holds each ordered
    action's (micro-batch, chain index). `chains` (of the same specs, pp and costs) saves preparing them again when
    several plans are made."""

    def __init__(self, specs: list[MicroBatch], pp: int, max_in_flight: int, max_open: int, costs: CostModel,
                 rule: str, longest_first: bool, jitter: float = 0.0, seed: int = 0, chains: Chains | None = None):
        self.pp, self.max_in_flight, self.max_open, self.rule = pp, max_in_flight, max_open, rule
        self.jitter, self.rng = jitter, random.Random(seed)
        self.c = chains or Chains(specs, pp, costs)
        self.tails = self.c.tails
        self.to_leave_end = [tail[leave + 1] for tail, leave in zip(self.tails, self.c.leave)]
        self.in_flight_for = [self._to_leave(mb, enter) for mb, enter in enumerate(self.c.enter)]
        self.waiting = list(range(len(specs)))
        if longest_first:
            self.waiting.sort(key=lambda mb: (-self.tails[mb][0], mb))
        self.entered = 0  # waiting[entered:] have not started yet
        self.next = [0] * len(specs)
        self.ready = [0.0] * len(specs)
        self.free = [0.0] * pp
        self.open: set[int] = set()
        self.in_flight: set[int] = set()
        self.orders: list[list[Compute]] = [[] for _ in range(pp)]
        self.positions: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
        self.remaining = list(self.c.work)
        self.at: list[list[int]] = [[] for _ in range(pp)]  # open micro-batches whose next action runs there
        self.begin = [_NEVER] * pp  # per rank, when it can start its next action
        self._update(0)

    def run(self, beat: float = _NEVER) -> tuple[float, list[list[Compute]]] | None:
        """(makespan, per-rank orders) of the plan; None, given `beat`, as soon as the plan cannot end before it:
        a rank that is free at t with w of work left ends no sooner than t + w + its `foot` (the margin covers
        rounding: a plan ending within 1e-9 of `beat` is not given up)."""
        cutoff = beat * (1.0 + 1e-9) + 1e-9
        free, remaining, foot, begin, ready = self.free, self.remaining, self.c.foot, self.begin, self.ready
        if any(w + f > cutoff for w, f in zip(remaining, foot)):
            return None
        while True:
            start = min(begin)
            if start == _NEVER:
                return max(free), self.orders
            rank = begin.index(start)  # the lowest rank of those that can start soonest
            candidates = [mb for mb in self._candidates(rank) if ready[mb] <= start]
            self._place(self._choose(candidates, start), rank, start)
            if free[rank] + remaining[rank] + foot[rank] > cutoff:
                return None

    def _candidates(self, rank: int) -> list[int]:
        """The micro-batches that may start their next action on `rank`: open ones there (but not one that would
        enter flight while the bound is reached), and on rank 0 the next waiting one while the open cap allows."""
        if rank:
            return self.at[rank]
        if len(self.in_flight) >= self.max_in_flight:
            here = [mb for mb in self.at[0] if self.next[mb] != self.c.enter[mb]]
        else:
            here = list(self.at[0])
        if self.entered < len(self.waiting) and len(self.open) < self.max_open:
            here.append(self.waiting[self.entered])
        return here

    def _update(self, rank: int) -> None:
        """The time `rank` can start its next action (never, without candidates)."""
        here = self._candidates(rank)
        soonest = min([self.ready[mb] for mb in here]) if here else _NEVER
        self.begin[rank] = soonest if soonest > self.free[rank] else self.free[rank]

    def _choose(self, ready: list[int], now: float) -> int:
        if self.rule == "critical-path":
            return ready[0] if len(ready) == 1 else max(ready, key=lambda mb: (self.tails[mb][self.next[mb]], -mb))
        if self.jitter:
            ready = [mb for mb in self.open if mb in ready] + [mb for mb in ready if mb not in self.open]
            jitter = {mb: self.jitter * self.rng.random() for mb in ready}
        if len(ready) == 1:
            return ready[0]
        latest = self._latest_starts(now, ready)
        if not self.jitter:
            return min(ready, key=lambda mb: (latest[mb], -self.tails[mb][self.next[mb]], mb))
        return min(ready, key=lambda mb: (latest[mb] + jitter[mb], -self.tails[mb][self.next[mb]], mb))

    def _to_leave(self, mb: int, i: int) -> float:
        """The time from the start of chain action i to the end of the micro-batch's last backward (from the
        start of flight: `in_flight_for[mb]`)."""
        return self.tails[mb][i] - self.to_leave_end[mb]

    def _latest_starts(self, now: float, wanted: list[int]) -> dict[int, float]:
        """The latest start of the `wanted` micro-batches' next actions that keeps the step as short as its
        remaining work: in flight, the end the busiest rank's remaining work allows minus the chain's remaining
        time; not yet in flight, the estimated time a slot frees for it (slots taken in order of progress) minus
        its remaining no-autograd laps. The estimate walks the micro-batches not in flight in that order and stops
        once it has every wanted one and (slack-coupled) every slot a wanted micro-batch in flight holds."""
        tails, nxt, enter, in_flight, to_end = self.tails, self.next, self.c.enter, self.in_flight, self.to_leave_end
        in_flight_for = self.in_flight_for
        end = now + max(self.remaining)
        latest = {mb: end - tails[mb][nxt[mb]] for mb in wanted if mb in in_flight}
        missing = len(wanted) - len(latest)
        coupled = self.rule == "slack-coupled"
        owned = len(latest) if coupled else 0  # slots held by wanted micro-batches in flight, not yet taken
        if not missing and not owned:
            return latest
        slots = [(now, -1)] * (self.max_in_flight - len(in_flight))
        slots += [(now + (tails[mb][nxt[mb]] - to_end[mb]), mb) for mb in in_flight]  # now + _to_leave
        heapq.heapify(slots)
        # most progress first; a stable sort, so ties stay in the open set's order (reverse keeps stability)
        queued = sorted([mb for mb in self.open if mb not in in_flight], key=nxt.__getitem__, reverse=True)
        for mb in queued + self.waiting[self.entered:]:
            (enter_at, owner), i = heapq.heappop(slots), nxt[mb]
            no_grad = tails[mb][i] - tails[mb][enter[mb]]
            if mb in wanted:
                latest[mb] = enter_at - no_grad
                missing -= 1
            if coupled and owner in latest:
                latest[owner] = min(latest[owner], now + no_grad - (tails[owner][nxt[owner]] - to_end[owner]))
                owned -= 1
            if not missing and not owned:
                return latest
            heapq.heappush(slots, (max(enter_at, now + no_grad) + in_flight_for[mb], -1))
        return latest

    def _place(self, mb: int, rank: int, start: float) -> None:
        c, i = self.c, self.next[mb]
        if i == 0:
            self.entered += 1
            self.open.add(mb)
        else:
            self.at[rank].remove(mb)
        if i == c.enter[mb]:
            self.in_flight.add(mb)
        elif i == c.leave[mb]:
            self.in_flight.discard(mb)
        duration = c.durations[mb][i]
        end = start + duration
        self.orders[rank].append(c.actions[mb][i])
        self.positions[rank].append((mb, i))
        self.remaining[rank] -= duration
        self.free[rank] = end
        self.next[mb] = i + 1
        if i + 1 == len(c.actions[mb]):
            self.open.discard(mb)
        else:
            ready = self.ready[mb] = end + c.hops[mb][i]
            there = c.ranks[mb][i + 1]
            self.at[there].append(mb)
            if there == 0:
                self._update(0)
            elif there != rank:  # one more candidate there: it can start at the later of free and ready
                begins = self.free[there] if self.free[there] > ready else ready
                if begins < self.begin[there]:
                    self.begin[there] = begins
        self._update(rank)
