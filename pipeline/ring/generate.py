"""The ring schedule: per-rank action lists for one optimizer step of looped micro-batches.

Every micro-batch is one chain of compute actions (see `actions`); the generator interleaves the chains of many
micro-batches on the ring by list scheduling against a cost model (`list_scheduler`): whenever a rank could start
something, it starts one of the actions whose inputs are there, the most urgent by a rule (longest remaining
chain, or earliest latest-start given when micro-batches can enter flight).

Two bounds hold memory:

- in flight: a micro-batch stores lap activations from its first lap with autograd (rank 0 first) until its last
  backward (rank 0 last); it starts that lap only while fewer than `max_in_flight` are in flight, so no rank ever
  holds more than `max_in_flight` micro-batches' lap activations;
- open: from its Embed to its EmbedBackward rank 0 keeps a micro-batch's e and prelude activations; micro-batches
  enter (Embed) only while fewer than the open cap are open.

A micro-batch's no-autograd laps store nothing besides e, so open micro-batches waiting for their turn in flight
are cheap fill between the others' laps.

The generator plans with each rule, micro-batches entering longest first or in the given order, and the open cap at
`max_open` or `max_in_flight` (the looser first: its plan is usually the shorter; then seeded restarts if asked),
leaving out settings that would repeat a plan, and keeps the plan with the shortest makespan. A plan is given up
as soon as it cannot end before the best so far, and the search stops at a plan within `tolerance` of
`lower_bound` (default 0.25%; 0: only at the bound, where the plan is optimal), so a schedule is at most that
fraction longer than the full search's. The trainer generates one every optimizer step, on the host, before any
compute: about 2 ms for pp = 2 and 8 micro-batches of 8 laps, 20 ms for pp = 8 and 16 micro-batches of 16 laps,
56 ms for pp = 8 and 32 of them (one CPU core; `python benchmarks/ring_schedule.py --timing`).

Because the orders come from a feasible timed run and Sends are asynchronous, the action lists cannot deadlock
(the simulator checks it anyway). With laps = grad_laps = v for every micro-batch the ring is interleaved 1F1B's
setting with v shared chunks, whose bubble of (p - 1)(f + b) per rank is also the least any ring schedule can have
(rank p-1 cannot start before p-1 forward segments and must end p-1 backward segments before the last rank 0
action); how close the plans come under a given memory bound is what benchmarks/ring_schedule.py measures.
"""
from __future__ import annotations

import operator
from typing import Sequence

from pipeline.ring.actions import Action, Compute, MicroBatch, ScheduleError
from pipeline.ring.costs import CostModel
from pipeline.ring.list_scheduler import RULES, Chains, ListScheduler
from pipeline.ring.p2p import add_p2p

TOLERANCE = 0.0025  # the search stops at a plan within this fraction of lower_bound (see the module docstring)


def ring_schedule(specs: Sequence[MicroBatch], pp: int, max_in_flight: int, max_open: int | None = None,
                  costs: CostModel = CostModel(), restarts: int = 0,
                  tolerance: float = TOLERANCE) -> list[list[Action]]:
    """Per-rank action lists (Sends and Recvs included) for the micro-batches `specs` on a ring of `pp` ranks:
    at most `max_in_flight` micro-batches hold lap activations on any rank, at most `max_open` (default
    2 * max_in_flight) are between their Embed and EmbedBackward. `restarts` extra plans with seeded jitter are
    tried while no plan is within `tolerance` (a fraction; 0: only at) of `lower_bound`, where the search stops."""
    plan = _best_plan(specs, pp, max_in_flight, max_open, costs, restarts, tolerance)
    return add_p2p(plan.orders, plan.positions, plan.c.actions, plan.c.ranks)


def ring_orders(specs: Sequence[MicroBatch], pp: int, max_in_flight: int, max_open: int | None = None,
                costs: CostModel = CostModel(), restarts: int = 0,
                tolerance: float = TOLERANCE) -> list[list[Compute]]:
    """The per-rank orders of compute actions (see `ring_schedule`)."""
    return _best_plan(specs, pp, max_in_flight, max_open, costs, restarts, tolerance).orders


def _best_plan(specs: Sequence[MicroBatch], pp: int, max_in_flight: int, max_open: int | None, costs: CostModel,
               restarts: int, tolerance: float) -> ListScheduler:
    """The run scheduler of the shortest plan over the settings (see the module docstring)."""
    pp, max_in_flight = operator.index(pp), operator.index(max_in_flight)
    max_open = 2 * max_in_flight if max_open is None else operator.index(max_open)
    if pp < 1 or not 1 <= max_in_flight <= max_open:
        raise ScheduleError(f"need pp >= 1 and 1 <= max_in_flight <= max_open, got pp={pp}, "
                            f"max_in_flight={max_in_flight}, max_open={max_open}")
    if not tolerance >= 0.0:
        raise ScheduleError(f"tolerance is a fraction of the lower bound, >= 0 (0: stop only at it), got {tolerance}")
    specs = list(specs)
    chains = Chains(specs, pp, costs)
    good_enough = _lower_bound(chains) * (1.0 + tolerance) + 1e-9
    settings = _settings(chains, max_in_flight, max_open, costs, restarts)
    best: tuple[float, ListScheduler] | None = None
    for rule, longest_first, cap, jitter, seed in settings:
        scheduler = ListScheduler(specs, pp, max_in_flight, cap, costs, rule, longest_first, jitter, seed, chains)
        plan = scheduler.run(beat=float("inf") if best is None else best[0])  # None: it would not end sooner
        if plan is not None and (best is None or plan[0] < best[0]):
            best = plan[0], scheduler
        if best[0] <= good_enough:
            break
    return best[1]


def _settings(chains: Chains, max_in_flight: int, max_open: int, costs: CostModel, restarts: int) -> list[tuple]:
    """(rule, longest_first, open cap, jitter, seed) of each plan to try, in order; a setting that would repeat
    an earlier plan is left out: an open cap of m or more never binds, and micro-batches already longest first
    enter in the same order either way."""
    m = len(chains.actions)
    # the looser open cap first: its plan is usually the shorter one
    caps = sorted({max(1, min(cap, m)) for cap in (max_in_flight, max_open)}, reverse=True)
    longest = sorted(range(m), key=lambda mb: (-chains.tails[mb][0], mb))
    orders = (True,) if longest == list(range(m)) else (True, False)
    settings = [(rule, first, cap, 0.0, 0) for rule in RULES for first in orders for cap in caps]
    # restarts: latest starts jittered by up to two laps around the ring, enough to swap micro-batches whose
    # remaining chains differ by a lap or so (smaller jitter only reorders near-ties)
    jitter = 2 * chains.pp * costs.forward
    return settings + [("slack-coupled", True, cap, jitter, seed) for seed in range(1, restarts + 1) for cap in caps]


def lower_bound(specs: Sequence[MicroBatch], pp: int, costs: CostModel = CostModel()) -> float:
    """A makespan no ring schedule of `specs` can beat: the longest chain; for each rank its work plus the least
    time before its first action (chain prefixes on other ranks) and after its last one; and, since a micro-batch
    is on one rank at a time, all work over min(micro-batches, pp)."""
    return _lower_bound(Chains(specs, pp, costs))


def _lower_bound(chains: Chains) -> float:
    if not chains.actions:
        return 0.0
    longest = max(tail[0] for tail in chains.tails)
    spread = sum(chains.work) / min(len(chains.actions), chains.pp)
    return max([longest, spread] + [h + w + f for h, w, f in zip(chains.head, chains.work, chains.foot)])
