"""One plan of the ring generator: list scheduling of the micro-batches' chains under the memory bounds.

The plan is a timed run against the cost model: repeatedly, the rank that can start something soonest starts one
of the actions whose inputs are there (it never idles while one is), chosen by its rule:

- "critical-path": the action whose chain has the longest remaining time;
- "slack": the action with the earliest latest-start (see `_latest_starts`), so no-autograd laps of micro-batches
  that cannot enter flight for a while wait as fill while the laps in flight go first;
- "slack-coupled": as "slack", but a micro-batch in flight is also due by the time the micro-batch waiting for its
  slot will be ready to enter.

`jitter` > 0 adds a seeded random amount in [0, jitter) to the latest starts, for restarts that explore other ties.
"""
from __future__ import annotations

import heapq
import random

from pipeline.ring.actions import Compute, MicroBatch, chain, rank_of
from pipeline.ring.costs import CostModel

RULES = ("slack-coupled", "slack", "critical-path")


def chain_tail(actions: list[Compute], durations: list[float], pp: int, latency: float) -> list[float]:
    """tail[i]: the time from the start of action i of a chain to the chain's end (latencies included)."""
    tail = [0.0] * (len(actions) + 1)
    for i in reversed(range(len(actions))):
        hop = latency if i + 1 < len(actions) and rank_of(actions[i + 1], pp) != rank_of(actions[i], pp) else 0.0
        tail[i] = durations[i] + hop + tail[i + 1]
    return tail


class ListScheduler:
    """Plans once; `run()` returns (makespan, per-rank compute orders)."""

    def __init__(self, specs: list[MicroBatch], pp: int, max_in_flight: int, max_open: int, costs: CostModel,
                 rule: str, longest_first: bool, jitter: float = 0.0, seed: int = 0):
        self.pp, self.max_in_flight, self.max_open, self.costs, self.rule = pp, max_in_flight, max_open, costs, rule
        self.jitter, self.rng = jitter, random.Random(seed)
        self.chains = [chain(mb, spec, pp) for mb, spec in enumerate(specs)]
        self.durations = [[costs.of(a, specs) for a in actions] for actions in self.chains]
        self.tails = [chain_tail(a, d, pp, costs.latency) for a, d in zip(self.chains, self.durations)]
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
        self.remaining = [0.0] * pp
        for actions, durations in zip(self.chains, self.durations):
            for action, duration in zip(actions, durations):
                self.remaining[rank_of(action, pp)] += duration

    def run(self) -> tuple[float, list[list[Compute]]]:
        """(makespan, per-rank orders) of the plan."""
        while True:
            candidates = self._candidates()
            if not candidates:
                return max(self.free), self.orders
            by_rank: dict[int, list[int]] = {}
            for mb in candidates:
                by_rank.setdefault(rank_of(self.chains[mb][self.next[mb]], self.pp), []).append(mb)
            start, rank = min((max(self.free[r], min(self.ready[mb] for mb in mbs)), r) for r, mbs in by_rank.items())
            ready = [mb for mb in by_rank[rank] if self.ready[mb] <= start]
            self._place(self._choose(ready, start), rank, start)

    def _candidates(self) -> list[int]:
        full = len(self.in_flight) >= self.max_in_flight
        running = [mb for mb in self.open if not (full and self.next[mb] == self.enter[mb])]
        if self.waiting and len(self.open) < self.max_open:
            running.append(self.waiting[0])
        return running

    def _choose(self, ready: list[int], now: float) -> int:
        if self.rule == "critical-path":
            return max(ready, key=lambda mb: (self.tails[mb][self.next[mb]], -mb))
        latest = self._latest_starts(now)
        jitter = {mb: self.jitter * self.rng.random() for mb in ready} if self.jitter else dict.fromkeys(ready, 0.0)
        return min(ready, key=lambda mb: (latest[mb] + jitter[mb], -self.tails[mb][self.next[mb]], mb))

    def _to_leave(self, mb: int, i: int) -> float:
        """The time from the start of chain action i to the end of the micro-batch's last backward."""
        return self.tails[mb][i] - self.tails[mb][self.leave[mb] + 1]

    def _latest_starts(self, now: float) -> dict[int, float]:
        """The latest start of each micro-batch's next action that keeps the step as short as its remaining work:
        in flight, the end the busiest rank's remaining work allows minus the chain's remaining time; not yet in
        flight, the estimated time a slot frees for it (slots taken in order of progress) minus its remaining
        no-autograd laps."""
        end = now + max(self.remaining)
        latest = {mb: end - self.tails[mb][self.next[mb]] for mb in self.in_flight}
        slots = [(now, -1)] * (self.max_in_flight - len(self.in_flight))
        slots += [(now + self._to_leave(mb, self.next[mb]), mb) for mb in self.in_flight]
        heapq.heapify(slots)
        queued = sorted((mb for mb in self.open if mb not in self.in_flight), key=lambda mb: -self.next[mb])
        for mb in queued + self.waiting:
            (enter_at, owner), i = heapq.heappop(slots), self.next[mb]
            no_grad = self.tails[mb][i] - self.tails[mb][self.enter[mb]]
            latest[mb] = enter_at - no_grad
            if owner in self.in_flight and self.rule == "slack-coupled":
                latest[owner] = min(latest[owner], now + no_grad - self._to_leave(owner, self.next[owner]))
            heapq.heappush(slots, (max(enter_at, now + no_grad) + self._to_leave(mb, self.enter[mb]), -1))
        return latest

    def _place(self, mb: int, rank: int, start: float) -> None:
        if self.next[mb] == 0:
            self.waiting.remove(mb)
            self.open.add(mb)
        i = self.next[mb]
        if i == self.enter[mb]:
            self.in_flight.add(mb)
        elif i == self.leave[mb]:
            self.in_flight.discard(mb)
        end = start + self.durations[mb][i]
        self.orders[rank].append(self.chains[mb][i])
        self.remaining[rank] -= self.durations[mb][i]
        self.free[rank] = end
        self.next[mb] = i + 1
        if i + 1 == len(self.chains[mb]):
            self.open.discard(mb)
        else:
            hop = self.costs.latency if rank_of(self.chains[mb][i + 1], self.pp) != rank else 0.0
            self.ready[mb] = end + hop
