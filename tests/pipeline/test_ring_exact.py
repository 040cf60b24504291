"""The exact ring-schedule search (benchmarks/ring_exact.py) against brute force over every per-rank order, a
hand-computed optimum, the generator's makespans and the lower bound."""
from __future__ import annotations

import itertools
import random

import pytest

from benchmarks.ring_exact import generated, one_change, solve, verify
from pipeline.ring import CostModel, MicroBatch, chain, lower_bound, rank_of, simulate, with_p2p

UNIFORM = CostModel(forward=1.0, backward=2.0)


def interleavings(sequences: list[list]):
    """Every merge of `sequences` that keeps each one's order."""
    if not any(sequences):
        yield []
        return
    for i, seq in enumerate(sequences):
        if seq:
            rest = sequences[:i] + [seq[1:]] + sequences[i + 1:]
            for tail in interleavings(rest):
                yield [seq[0]] + tail


def timed(orders, specs, pp: int, costs: CostModel) -> float | None:
    """The makespan of per-rank `orders` (each action at the later of its rank's previous end and its chain
    predecessor's end plus the latency across ranks), None if they wait on each other forever."""
    before = {}
    for mb, spec in enumerate(specs):
        actions = chain(mb, spec, pp)
        before.update(zip(actions[1:], actions[:-1]))
    end, clock, pos = {}, [0.0] * pp, [0] * pp
    while any(p < len(o) for p, o in zip(pos, orders)):
        moved = False
        for rank, order in enumerate(orders):
            while pos[rank] < len(order):
                action, producer = order[pos[rank]], before.get(order[pos[rank]])
                if producer is not None and producer not in end:
                    break
                ready = 0.0 if producer is None else end[producer] + (
                    costs.latency if rank_of(producer, pp) != rank else 0.0)
                clock[rank] = end[action] = max(clock[rank], ready) + costs.of(action, specs)
                pos[rank] += 1
                moved = True
        if not moved:
            return None
    return max(clock)


def brute_force(specs, pp: int, costs: CostModel) -> float:
    per_rank = [[[a for a in chain(mb, spec, pp) if rank_of(a, pp) == rank] for mb, spec in enumerate(specs)]
                for rank in range(pp)]
    spans = (timed(list(orders), specs, pp, costs)
             for orders in itertools.product(*(list(interleavings(seqs)) for seqs in per_rank)))
    return min(span for span in spans if span is not None)


def test_two_one_lap_micro_batches_by_hand():
    """pp 2, two micro-batches of one lap with autograd: rank 1 cannot start before 1 (micro-batch A's forward on
    rank 0), then runs 2 forwards and 2 backwards (1 + 1 + 2 + 2), and the last backward on rank 0 (2) follows its
    last action: 1 + 6 + 2 = 9, reached by A's F, B's F, A's B, B's B on rank 1."""
    specs = [MicroBatch(1, 1), MicroBatch(1, 1)]
    result = solve(specs, 2, UNIFORM)
    assert result.best == pytest.approx(9.0, abs=1e-12)
    assert result.proven
    assert verify(result.orders, specs, UNIFORM) == pytest.approx(9.0, abs=1e-12)


@pytest.mark.parametrize("laps, costs", [
    ([(2, 1), (1, 1)], UNIFORM),
    ([(2, 2), (1, 1)], CostModel(forward=1.0, backward=2.0, nograd_forward=0.5, latency=0.25)),
    ([(2, 1), (2, 1)], CostModel(forward=1.0, backward=3.0, embed=0.5, loss=1.0, embed_backward=0.5,
                                 loss_backward=0.25)),
])
def test_matches_brute_force_over_every_order(laps, costs):
    """pp 2, two micro-batches: the proven optimum is the least makespan over every pair of per-rank orders."""
    specs = [MicroBatch(n, k) for n, k in laps]
    result = solve(specs, 2, costs)
    assert result.proven
    assert result.best == pytest.approx(brute_force(specs, 2, costs), abs=1e-12)
    assert verify(result.orders, specs, costs) == pytest.approx(result.best, abs=1e-12)


def test_some_brute_force_case_is_above_the_lower_bound():
    """The brute-force comparison reaches past lower_bound: with micro-batches of 2 and 1 laps and a latency the
    optimum is above it, and the search proves that optimum."""
    specs = [MicroBatch(2, 1), MicroBatch(1, 1)]
    costs = CostModel(forward=1.0, backward=2.0, nograd_forward=0.5, latency=0.25)
    best = brute_force(specs, 2, costs)
    assert best > lower_bound(specs, 2, costs) + 1e-9
    result = solve(specs, 2, costs)
    assert result.proven and result.best == pytest.approx(best, abs=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_never_above_the_generator_and_at_the_bound_where_it_is(seed):
    """Random small rings: the exact optimum is at most the generator's makespan, at least lower_bound, and equal
    to lower_bound where the generator reaches it; the non-delay optimum lies between the two."""
    rng = random.Random(seed)
    pp, m = rng.choice([2, 3, 4]), rng.choice([2, 3, 4])
    specs = [MicroBatch(n, rng.randint(1, n)) for n in (rng.randint(1, 4) for _ in range(m))]
    span, orders = generated(specs, pp, UNIFORM, in_flight=3, restarts=2)
    floor = lower_bound(specs, pp, UNIFORM)
    result = solve(specs, pp, UNIFORM, span, orders, time_limit=20.0)
    assert result.proven, f"not proven in 20 s: {specs}, pp {pp}"
    assert floor - 1e-12 <= result.best <= span + 1e-12
    if span <= floor + 1e-12:
        assert result.best == pytest.approx(floor, abs=1e-12)
    assert verify(result.orders, specs, UNIFORM) == pytest.approx(result.best, abs=1e-12)
    lazy = solve(specs, pp, UNIFORM, span, orders, time_limit=20.0, non_delay=True)
    assert lazy.proven and result.best - 1e-12 <= lazy.best <= span + 1e-12


def test_the_case_above_the_idle_target():
    """pp 4, micro-batches of (14, 4), (11, 4), (9, 4), (13, 4) laps: the search finds a schedule shorter than the
    generator's, which the simulator confirms and which stays within the generator's memory bounds."""
    specs = [MicroBatch(n, k) for n, k in [(14, 4), (11, 4), (9, 4), (13, 4)]]
    span, orders = generated(specs, 4, UNIFORM, in_flight=3, restarts=8)
    result = solve(specs, 4, UNIFORM, span, orders, time_limit=60.0)
    assert result.proven and result.improved and result.best < span
    assert result.best >= lower_bound(specs, 4, UNIFORM) - 1e-12
    run = simulate(with_p2p(result.orders, specs), specs, UNIFORM, max_in_flight=12, max_open=24)
    assert run.makespan == pytest.approx(result.best, abs=1e-12)


def test_time_limit_keeps_the_incumbent_unproven():
    specs = [MicroBatch(n, 4) for n in (14, 11, 9, 13)]
    span, orders = generated(specs, 4, UNIFORM, in_flight=3, restarts=0)
    result = solve(specs, 4, UNIFORM, span, orders, time_limit=0.0)
    assert result.nodes >= 1 and result.best <= span


def test_zero_cost_action_after_another_rank_is_refused():
    with pytest.raises(ValueError, match="costs nothing"):
        solve([MicroBatch(1, 1)], 2, CostModel(forward=0.0, backward=1.0, nograd_forward=0.0))


def test_one_changed_choice_of_the_critical_path_schedule():
    """The critical-path list schedule's makespan is its simulated one, and each reported change of one choice
    gives a shorter schedule, never below the exact optimum; in the case above the idle target one reaches it."""
    specs = [MicroBatch(n, 4) for n in (14, 11, 9, 13)]
    base, orders, better = one_change(specs, 4, UNIFORM)
    assert verify(orders, specs, UNIFORM) == pytest.approx(base, abs=1e-12)
    best = solve(specs, 4, UNIFORM, time_limit=60.0)
    assert best.proven and better
    assert all(best.best - 1e-12 <= span < base for *_, span in better)
    assert min(span for *_, span in better) == pytest.approx(best.best, abs=1e-12)
