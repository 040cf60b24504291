"""A straightforward implementation of the ring generator (pipeline.ring.generate, list_scheduler, p2p): every
placement rescans every candidate and recomputes every micro-batch's latest start, and the point-to-point pass
looks actions up by value. It is the generator as first written, kept as the reference that the optimised one must
reproduce action for action (tests/pipeline/test_ring_schedule.py, benchmarks/ring_schedule.py --timing)."""
from __future__ import annotations

import heapq
import random
from collections import deque

from pipeline.ring.actions import Message, Recv, ScheduleError, Send, chain, rank_of
from pipeline.ring.costs import CostModel

RULES = ("slack-coupled", "slack", "critical-path")


def reference_schedule(specs, pp, max_in_flight, max_open=None, costs=None, restarts=0, tolerance=0.0,
                       open_first=True):
    """The per-rank action lists, as pipeline.ring.ring_schedule with the same arguments: every setting is
    planned in full until one is within `tolerance` of the lower bound. `open_first`: plans with the open cap at
    max_open before those at max_in_flight (as pipeline.ring); False: the other way round, as first written."""
    costs = CostModel() if costs is None else costs
    max_open = 2 * max_in_flight if max_open is None else max_open
    specs = list(specs)
    bound = lower_bound(specs, pp, costs) * (1.0 + tolerance)
    caps = sorted({max_in_flight, max_open}, reverse=open_first)
    settings = [(rule, first, cap, 0.0, 0) for rule in RULES for first in (True, False) for cap in caps]
    settings += [("slack-coupled", True, cap, costs.forward, seed) for seed in range(1, restarts + 1) for cap in caps]
    best = None
    for rule, longest_first, cap, jitter, seed in settings:
        plan = ReferenceScheduler(specs, pp, max_in_flight, cap, costs, rule, longest_first, jitter, seed).run()
        if best is None or plan[0] < best[0]:
            best = plan
        if best[0] <= bound + 1e-9:
            break
    return reference_p2p(best[1], specs)


def chain_tail(actions, durations, pp, latency):
    """tail[i]: the time from the start of action i of a chain to the chain's end (latencies included)."""
    tail = [0.0] * (len(actions) + 1)
    for i in reversed(range(len(actions))):
        hop = latency if i + 1 < len(actions) and rank_of(actions[i + 1], pp) != rank_of(actions[i], pp) else 0.0
        tail[i] = durations[i] + hop + tail[i + 1]
    return tail


def lower_bound(specs, pp, costs):
    """The longest chain, each rank's work plus its least head and foot, and all work over min(m, pp)."""
    chains = [chain(mb, spec, pp) for mb, spec in enumerate(specs)]
    if not chains:
        return 0.0
    work, head, foot = [0.0] * pp, [float("inf")] * pp, [float("inf")] * pp
    longest = 0.0
    for actions in chains:
        durations = [costs.of(a, specs) for a in actions]
        tail = chain_tail(actions, durations, pp, costs.latency)
        longest = max(longest, tail[0])
        ranks = [rank_of(a, pp) for a in actions]
        for rank in range(pp):
            first, last = ranks.index(rank), len(ranks) - 1 - ranks[::-1].index(rank)
            head[rank] = min(head[rank], tail[0] - tail[first])
            foot[rank] = min(foot[rank], tail[last] - durations[last])
        for rank, duration in zip(ranks, durations):
            work[rank] += duration
    spread = sum(work) / min(len(chains), pp)
    return max([longest, spread] + [h + w + f for h, w, f in zip(head, work, foot)])


class ReferenceScheduler:
    """One plan; `run()` returns (makespan, per-rank compute orders)."""

    def __init__(self, specs, pp, max_in_flight, max_open, costs, rule, longest_first, jitter=0.0, seed=0):
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
        self.enter = [1 + pp * spec.first_grad_lap for spec in specs]
        self.leave = [len(actions) - 2 for actions in self.chains]
        self.open, self.in_flight = set(), set()
        self.orders = [[] for _ in range(pp)]
        self.remaining = [0.0] * pp
        for actions, durations in zip(self.chains, self.durations):
            for action, duration in zip(actions, durations):
                self.remaining[rank_of(action, pp)] += duration

    def run(self):
        while True:
            full = len(self.in_flight) >= self.max_in_flight
            candidates = [mb for mb in self.open if not (full and self.next[mb] == self.enter[mb])]
            if self.waiting and len(self.open) < self.max_open:
                candidates.append(self.waiting[0])
            if not candidates:
                return max(self.free), self.orders
            by_rank = {}
            for mb in candidates:
                by_rank.setdefault(rank_of(self.chains[mb][self.next[mb]], self.pp), []).append(mb)
            start, rank = min((max(self.free[r], min(self.ready[mb] for mb in mbs)), r) for r, mbs in by_rank.items())
            ready = [mb for mb in by_rank[rank] if self.ready[mb] <= start]
            self._place(self._choose(ready, start), rank, start)

    def _choose(self, ready, now):
        if self.rule == "critical-path":
            return max(ready, key=lambda mb: (self.tails[mb][self.next[mb]], -mb))
        latest = self._latest_starts(now)
        jitter = {mb: self.jitter * self.rng.random() for mb in ready} if self.jitter else dict.fromkeys(ready, 0.0)
        return min(ready, key=lambda mb: (latest[mb] + jitter[mb], -self.tails[mb][self.next[mb]], mb))

    def _to_leave(self, mb, i):
        return self.tails[mb][i] - self.tails[mb][self.leave[mb] + 1]

    def _latest_starts(self, now):
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

    def _place(self, mb, rank, start):
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


def reference_p2p(orders, specs):
    """The compute `orders` with a Send after each action whose successor runs elsewhere and the Recvs in each
    channel's send order (as pipeline.ring.with_p2p)."""
    pp = len(orders)
    before, after = {}, {}
    for mb, spec in enumerate(specs):
        actions = chain(mb, spec, pp)
        for first, second in zip(actions, actions[1:]):
            after[first], before[second] = second, first
    channels, with_sends = {}, []
    for rank, order in enumerate(orders):
        actions = []
        for action in order:
            actions.append(action)
            successor = after.get(action)
            if successor is not None and rank_of(successor, pp) != rank:
                dst = rank_of(successor, pp)
                actions.append(Send(dst, Message(action)))
                channels.setdefault((rank, dst), deque()).append(Message(action))
        with_sends.append(actions)
    out = []
    for rank, actions in enumerate(with_sends):
        received, listed = set(), []
        for action in actions:
            producer = before.get(action)
            if producer is not None and rank_of(producer, pp) != rank:
                src = rank_of(producer, pp)
                queue = channels.get((src, rank), deque())
                while Message(producer) not in received:
                    if not queue:
                        raise ScheduleError(f"rank {rank} never receives the output of {producer}")
                    message = queue.popleft()
                    listed.append(Recv(src, message))
                    received.add(message)
            listed.append(action)
        out.append(listed)
    return out
