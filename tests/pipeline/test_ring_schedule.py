"""The ring pipeline schedule as data: generator, baselines, simulator and Gantt chart (pure Python, fast)."""
from __future__ import annotations

import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from pipeline.ring import (
    Backward,
    CostModel,
    DeadlockError,
    Forward,
    MicroBatch,
    Recv,
    ScheduleError,
    Send,
    chain,
    gpipe,
    interleaved_1f1b,
    lower_bound,
    one_f_one_b,
    rank_of,
    ring_schedule,
    simulate,
    uniform_specs,
)
from pipeline.ring.gantt import gantt_chart
from pipeline.ring.list_scheduler import RULES, ListScheduler
from pipeline.ring.p2p import with_p2p

UNIFORM = CostModel(forward=1.0, backward=2.0)


def random_specs(m: int, mu_rec: int, seed: int) -> list[MicroBatch]:
    """m micro-batches with laps drawn around mu_rec and k = min(laps, ceil(mu_rec / 2))."""
    rng = random.Random(seed)
    specs = []
    for _ in range(m):
        laps = max(1, round(rng.gauss(mu_rec, mu_rec ** 0.5)))
        specs.append(MicroBatch(laps, min(laps, -(-mu_rec // 2))))
    return specs


RING_CASES = [(2, 6, 4, 3), (3, 5, 6, 2), (4, 8, 8, 4)]  # (pp, m, mu_rec, max_in_flight)


@pytest.mark.parametrize("pp,m,mu_rec,bound", RING_CASES)
def test_every_micro_batch_runs_its_laps_in_order_on_every_rank(pp, m, mu_rec, bound):
    specs = random_specs(m, mu_rec, seed=pp)
    schedule = ring_schedule(specs, pp, bound)
    for rank, actions in enumerate(schedule):
        forwards = Counter()
        for action in actions:
            if isinstance(action, Forward):
                spec = specs[action.mb]
                assert action.stage == rank and action.lap == forwards[action.mb]
                assert action.grad == (action.lap >= spec.laps - spec.grad_laps)
                forwards[action.mb] += 1
        for mb, spec in enumerate(specs):
            assert forwards[mb] == spec.laps
            laps = [a.lap for a in actions if isinstance(a, Backward) and a.mb == mb]
            assert laps == list(reversed(range(spec.laps - spec.grad_laps, spec.laps)))
            assert all(a.stage == rank for a in actions if isinstance(a, Backward))
    expected = Counter(rank_of(a, pp) for mb, spec in enumerate(specs) for a in chain(mb, spec, pp))
    computed = Counter(r for r, actions in enumerate(schedule) for a in actions if not isinstance(a, (Send, Recv)))
    assert computed == expected


@pytest.mark.parametrize("pp,m,mu_rec,bound", RING_CASES + [(2, 4, 4, 2)])
def test_sends_match_recvs_in_channel_order(pp, m, mu_rec, bound):
    schedule = ring_schedule(random_specs(m, mu_rec, seed=m), pp, bound)
    sends, recvs = {}, {}
    for rank, actions in enumerate(schedule):
        for a in actions:
            if isinstance(a, Send):
                sends.setdefault((rank, a.dst), []).append(a.message)
            elif isinstance(a, Recv):
                recvs.setdefault((a.src, rank), []).append(a.message)
    assert sends == recvs and sends
    for (src, dst), messages in sends.items():
        assert dst in ((src + 1) % pp, (src - 1) % pp)  # ring neighbours only
        assert all(rank_of(msg.producer, pp) == src for msg in messages)


@pytest.mark.parametrize("pp,m,mu_rec,bound", RING_CASES + [(2, 4, 4, 2)])
def test_rendezvous_semantics_cannot_deadlock_the_ring_but_the_shared_posting_can(pp, m, mu_rec, bound):
    """Under NCCL's semantics with one group per channel direction (p2p "rendezvous") a schedule runs exactly as with
    free sends (a Send never holds up its rank; with zero latency not even the makespan changes); with every message
    of a rank on one group, each run of Sends and Recvs one batch waited for whole (p2p "shared", the earlier
    executor), ranks block at batches that send to each other (benchmarks/ring_schedule.py: the 27-case grid)."""
    specs = random_specs(m, mu_rec, seed=m)
    schedule = ring_schedule(specs, pp, bound)
    free = simulate(schedule, specs, UNIFORM)
    assert simulate(schedule, specs, UNIFORM, p2p="rendezvous").makespan == free.makespan
    slow = CostModel(forward=1.0, backward=2.0, latency=0.5)
    assert simulate(schedule, specs, slow, p2p="rendezvous").makespan >= simulate(schedule, specs, slow).makespan
    with pytest.raises(DeadlockError, match=r"deadlock: rank \d waits at Send\(") as err:
        simulate(schedule, specs, UNIFORM, p2p="shared")
    assert any(isinstance(action, Send) for _, action in err.value.cycle)


def _two_lap_schedule():
    specs = [MicroBatch(2, 1)]
    return specs, ring_schedule(specs, 2, 1)


def test_simulator_reports_the_cycle_of_a_deadlock():
    specs, schedule = _two_lap_schedule()
    rank0 = schedule[0]
    wrap = next(i for i, a in enumerate(rank0) if isinstance(a, Recv))  # the lap-0 activation coming back
    first_send = next(i for i, a in enumerate(rank0) if isinstance(a, Send))
    broken = [rank0[:first_send] + [rank0[wrap]] + rank0[first_send:wrap] + rank0[wrap + 1:], schedule[1]]
    simulate(schedule, specs)  # the original runs
    with pytest.raises(DeadlockError) as info:
        simulate(broken, specs)
    assert sorted(rank for rank, _ in info.value.cycle) == [0, 1]
    assert "deadlock" in str(info.value) and "rank 0 waits" in str(info.value)


def test_simulator_rejects_recvs_out_of_channel_order_and_missing_sends():
    specs = uniform_specs(2)
    schedule = gpipe(2, 2)
    rank1 = schedule[1]
    recv_positions = [i for i, a in enumerate(rank1) if isinstance(a, Recv)][:2]
    swapped = list(rank1)
    swapped[recv_positions[0]], swapped[recv_positions[1]] = rank1[recv_positions[1]], rank1[recv_positions[0]]
    with pytest.raises(ScheduleError, match="Send order"):
        simulate([schedule[0], swapped], specs)
    no_sends = [schedule[0], [a for a in schedule[1] if not isinstance(a, Send)]]
    with pytest.raises(DeadlockError, match="finished without sending"):
        simulate(no_sends, specs)
    with pytest.raises(ScheduleError, match="never runs"):
        simulate([schedule[0][:0], schedule[1][:0]], specs)


@pytest.mark.parametrize("pp,m", [(1, 3), (2, 4), (4, 4), (4, 7), (8, 16)])
@pytest.mark.parametrize("f,b", [(1.0, 2.0), (1.5, 2.5)])
def test_gpipe_and_1f1b_makespans_match_the_closed_form(pp, m, f, b):
    costs = CostModel(forward=f, backward=b)
    closed = (m + pp - 1) * (f + b)
    assert simulate(gpipe(pp, m), uniform_specs(m), costs).makespan == pytest.approx(closed, abs=1e-12)
    one = simulate(one_f_one_b(pp, m), uniform_specs(m), costs)
    assert one.makespan == pytest.approx(closed, abs=1e-12)
    assert one.peak_in_flight == [min(pp - r, m) for r in range(pp)]  # 1F1B's known activation profile


@pytest.mark.parametrize("pp,m,v", [(2, 4, 2), (4, 8, 3), (4, 4, 4)])
def test_interleaved_1f1b_makespan_matches_the_closed_form(pp, m, v):
    result = simulate(interleaved_1f1b(pp, m, v), uniform_specs(m, v), UNIFORM)
    assert result.makespan == pytest.approx((m * v + pp - 1) * 3.0, abs=1e-12)


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 6)])
def test_gpipe_makespan_with_latency(pp, m):
    costs = CostModel(forward=1.0, backward=2.0, latency=0.25)
    expected = (m + pp - 1) * 3.0 + 2 * (pp - 1) * 0.25  # one hop per stage boundary, forward and backward
    assert simulate(gpipe(pp, m), uniform_specs(m), costs).makespan == pytest.approx(expected, abs=1e-12)


def test_a_single_ragged_micro_batch_costs_the_sum_of_its_chain():
    spec = MicroBatch(3, 2, active=(0.5, 0.75, 1.0))
    costs = CostModel(forward=1.0, backward=2.0, nograd_forward=0.8, embed=0.3, embed_backward=0.6, loss=0.4,
                      loss_backward=0.7, latency=0.1)
    pp = 3
    result = simulate(ring_schedule([spec], pp, 1), [spec], costs)
    forward = pp * (0.8 * 0.5 + 1.0 * 0.75 + 1.0 * 1.0)
    backward = pp * 2.0 * (0.75 + 1.0)
    hops = (3 * pp - 1) + (2 * pp - 1)  # 3 laps of forward hops, 2 laps of backward hops
    expected = 0.3 + forward + 0.4 + 0.7 + backward + 0.6 + hops * 0.1
    assert result.makespan == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("pp,m,mu_rec,bound", [(2, 8, 8, 2), (4, 10, 6, 3), (4, 8, 16, 8)])
def test_stored_activations_stay_within_the_bounds(pp, m, mu_rec, bound):
    specs = random_specs(m, mu_rec, seed=bound)
    result = simulate(ring_schedule(specs, pp, bound, 2 * bound), specs, UNIFORM, bound, 2 * bound)
    assert max(result.peak_in_flight) <= bound and result.peak_open <= 2 * bound
    assert max(result.peak_stored) <= bound * max(s.grad_laps for s in specs) + 2 * bound + 1
    with pytest.raises(ScheduleError, match="exceed the bound"):
        simulate(ring_schedule(specs, pp, bound + 1), specs, UNIFORM, max_in_flight=0)


@pytest.mark.parametrize("pp,m,v", [(2, 4, 2), (2, 8, 2), (4, 8, 2), (4, 8, 4), (8, 16, 2)])
def test_ring_bubble_is_at_most_interleaved_1f1b_with_as_many_laps(pp, m, v):
    specs = uniform_specs(m, v)
    ring = simulate(ring_schedule(specs, pp, 2 * pp), specs, UNIFORM, 2 * pp)
    interleaved = simulate(interleaved_1f1b(pp, m, v), specs, UNIFORM)
    assert interleaved.peak_in_flight[0] == min(2 * pp, m)  # the same bound holds interleaved 1F1B's activations
    assert ring.idle_fraction <= (pp - 1) / (v * m) + 1e-12
    assert ring.makespan <= interleaved.makespan + 1e-12


@pytest.mark.parametrize("pp,m,mu_rec", [(4, 8, 8), (8, 16, 4), (2, 8, 4)])
def test_ring_bubble_with_sampled_laps_is_at_most_interleaved_1f1b_of_equal_work(pp, m, mu_rec):
    specs = random_specs(m, mu_rec, seed=3)
    ring = simulate(ring_schedule(specs, pp, 2 * pp), specs, UNIFORM, 2 * pp)
    work = sum(s.laps * 1.0 + s.grad_laps * 2.0 for s in specs)
    v = work / (m * 3.0)  # full laps (forward + backward) with the same work per micro-batch
    assert ring.idle_fraction <= (pp - 1) / (v * m) + 1e-12


@pytest.mark.parametrize("pp,m", [(1, 2), (2, 4), (4, 3), (4, 8)])
def test_lower_bound_is_the_1f1b_closed_form_and_below_every_schedule(pp, m):
    assert lower_bound(uniform_specs(m), pp, UNIFORM) == pytest.approx((m + pp - 1) * 3.0, abs=1e-12)
    assert lower_bound([], pp) == 0.0 and ring_schedule([], pp, 1) == [[] for _ in range(pp)]
    specs = random_specs(m, 6, seed=pp + m)
    bound = lower_bound(specs, pp, UNIFORM)
    for max_in_flight in (1, pp, m):
        ring = simulate(ring_schedule(specs, pp, max_in_flight), specs, UNIFORM)
        assert ring.makespan >= bound - 1e-9


@pytest.mark.parametrize("rule", RULES)
def test_simulated_plan_takes_exactly_the_planned_time(rule):
    """The generator's timed plan and the simulator agree, latency, embedding/loss costs and ragged laps included:
    the Recvs added in channel order never make a rank wait longer than the plan assumed."""
    rng = random.Random(7)
    specs = [MicroBatch(laps, min(laps, 3), tuple(rng.choice((0.25, 0.5, 1.0)) for _ in range(laps - 1)) + (1.0,))
             for laps in (5, 2, 7, 4, 6, 3)]
    costs = CostModel(forward=1.0, backward=2.1, nograd_forward=0.9, embed=0.7, embed_backward=1.1, loss=1.3,
                      loss_backward=0.6, latency=0.15)
    for pp, bound in ((2, 2), (3, 4), (4, 3)):
        makespan, orders = ListScheduler(specs, pp, bound, 2 * bound, costs, rule, True).run()
        result = simulate(with_p2p(orders, specs), specs, costs, bound, 2 * bound)
        assert result.makespan == pytest.approx(makespan, rel=1e-12)


def test_gantt_chart_writes_a_small_png(tmp_path):
    specs = random_specs(6, 4, seed=1)
    result = simulate(ring_schedule(specs, 3, 3), specs, UNIFORM)
    path = gantt_chart(result, tmp_path / "ring.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 1_000 < len(data) < 200_000


def test_the_schedule_package_is_pure_python():
    """Generator, baselines and simulator import neither torch nor matplotlib (the Gantt chart loads it lazily)."""
    code = ("import sys, pipeline.ring, pipeline.ring.gantt; "
            "print(sorted(m for m in ('torch', 'matplotlib', 'numpy') if m in sys.modules))")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_generator_refuses_bad_bounds_and_specs():
    with pytest.raises(ScheduleError, match="max_in_flight"):
        ring_schedule([MicroBatch(2, 1)], 2, 0)
    with pytest.raises(ScheduleError, match="grad_laps"):
        MicroBatch(2, 3)
    with pytest.raises(ScheduleError, match="multiple of pp"):
        interleaved_1f1b(4, 6, 2)


def test_per_byte_latency_delays_each_message_by_its_bytes():
    """One micro-batch at pp 2 crosses the ring boundary twice (lap 0's state, its gradient): makespan = forward 1 +
    hop + forward 1 + backward 2 + hop + backward 2, a hop being latency + latency_per_byte x bytes; the bytes scale
    with the lap's active rows, as its compute does."""
    spec = MicroBatch(1, 1)
    schedule = ring_schedule([spec], 2, 1)
    plain = CostModel(forward=1.0, backward=2.0, latency=0.5)
    per_byte = CostModel(forward=1.0, backward=2.0, latency=0.5, latency_per_byte=0.25, message_bytes=2.0)
    assert simulate(schedule, [spec], plain).makespan == pytest.approx(6.0 + 2 * 0.5, abs=1e-12)
    assert simulate(schedule, [spec], per_byte).makespan == pytest.approx(6.0 + 2 * (0.5 + 0.5), abs=1e-12)
    half = MicroBatch(1, 1, active=(0.5,))
    expected = 3.0 + 2 * (0.5 + 0.25 * 2.0 * 0.5)
    assert simulate(ring_schedule([half], 2, 1), [half], per_byte).makespan == pytest.approx(expected, abs=1e-12)


def test_rendezvous_moves_a_message_only_once_its_recv_is_posted():
    """Two one-lap micro-batches at pp 2, hand-timed (forward 1, backward 2, latency 1). Rank 0 sends mb 1's state
    at t=2 while rank 1 is in mb 0's backward until t=5: sent ahead it arrives at 3 and rank 1 goes on at 5
    (makespan 11); with rendezvous it moves only once rank 1 posts its Recv at 5, arrives at 6, and everything after
    shifts by one (makespan 12; each rank busy 6, idle half)."""
    from pipeline.ring.actions import Embed, EmbedBackward, Loss, LossBackward

    specs = [MicroBatch(1, 1), MicroBatch(1, 1)]
    orders = [[Embed(0), Forward(0, 0, 0, True), Embed(1), Forward(1, 0, 0, True), Backward(0, 0, 0), EmbedBackward(0),
               Backward(1, 0, 0), EmbedBackward(1)],
              [Forward(0, 0, 1, True), Loss(0), LossBackward(0), Backward(0, 0, 1), Forward(1, 0, 1, True), Loss(1),
               LossBackward(1), Backward(1, 0, 1)]]
    schedule = with_p2p(orders, specs)
    eager = simulate(schedule, specs, CostModel(forward=1.0, backward=2.0, latency=1.0))
    rendezvous = simulate(schedule, specs, CostModel(forward=1.0, backward=2.0, latency=1.0, rendezvous=True))
    assert eager.makespan == pytest.approx(11.0, abs=1e-12)
    assert rendezvous.makespan == pytest.approx(12.0, abs=1e-12)
    assert rendezvous.idle_fractions == pytest.approx([0.5, 0.5], abs=1e-12)


def _mixed_cases() -> list[tuple]:
    """Small (specs, pp, max_in_flight, max_open, costs, restarts) sets: sampled laps, ragged laps, latencies and
    embedding / loss costs that are not binary fractions, open caps above and below m, restarts."""
    rng = random.Random(11)
    odd = CostModel(forward=1.0, backward=2.1, nograd_forward=0.9, embed=0.7, embed_backward=1.1, loss=1.3,
                    loss_backward=0.6, latency=0.15)
    cases = []
    for i, (pp, m, mu_rec) in enumerate([(2, 5, 4), (3, 7, 4), (4, 8, 6), (4, 12, 4), (2, 9, 6), (3, 4, 8)]):
        specs = random_specs(m, mu_rec, seed=i)
        if i % 2:
            specs = [MicroBatch(s.laps, s.grad_laps, tuple(rng.choice((0.25, 0.5, 1.0)) for _ in range(s.laps)))
                     for s in specs]
        bound = rng.choice((1, 2, pp))
        cases.append((specs, pp, bound, None if i % 3 else 3 * bound, odd if i % 2 else UNIFORM, int(i % 3 == 2)))
    return cases


@pytest.mark.parametrize("tolerance", [0.0, 0.0025, 0.05])
def test_generator_gives_the_action_lists_of_the_straightforward_reference(tolerance):
    """The optimised generator (candidates kept per rank, latest starts only for the ready micro-batches, plans
    given up once they cannot win, p2p by chain position) gives the very lists of the reference that rescans and
    recomputes everything (tests/pipeline/ring_reference.py) under the same settings."""
    from tests.pipeline.ring_reference import reference_schedule

    for specs, pp, bound, max_open, costs, restarts in _mixed_cases():
        expected = reference_schedule(specs, pp, bound, max_open, costs, restarts, tolerance)
        assert ring_schedule(specs, pp, bound, max_open, costs, restarts, tolerance) == expected


def test_open_cap_first_and_tolerance_keep_the_first_written_makespan_or_cost_at_most_the_tolerance():
    """Planning with the looser open cap first picks among the same plans (or stops at the lower bound), so at
    tolerance 0 the simulated makespan is the first-written generator's; a tolerance t may cost at most t."""
    from tests.pipeline.ring_reference import reference_schedule

    for specs, pp, bound, max_open, costs, restarts in _mixed_cases():
        open_cap = 2 * bound if max_open is None else max_open
        first = reference_schedule(specs, pp, bound, max_open, costs, restarts, 0.0, open_first=False)
        reference = simulate(first, specs, costs, bound, open_cap).makespan
        for tolerance in (0.0, 0.01, 0.1):
            schedule = ring_schedule(specs, pp, bound, max_open, costs, restarts, tolerance)
            span = simulate(schedule, specs, costs, bound, open_cap).makespan
            if tolerance == 0.0:
                assert span == pytest.approx(reference, rel=1e-12)
            assert span <= reference * (1.0 + tolerance) + 1e-9


def test_a_plan_is_given_up_only_when_it_cannot_end_before_the_best():
    """run(beat) gives up (None) a plan that ends at M when beat < M, and with beat > M returns the very plan of an
    unbounded run."""
    specs, costs = random_specs(8, 6, seed=3), CostModel(forward=1.0, backward=2.1, latency=0.15)
    for rule in RULES:
        makespan, orders = ListScheduler(specs, 4, 4, 8, costs, rule, True).run()
        assert ListScheduler(specs, 4, 4, 8, costs, rule, True).run(beat=makespan - 0.5) is None
        assert ListScheduler(specs, 4, 4, 8, costs, rule, True).run(beat=makespan + 0.5) == (makespan, orders)


def test_a_large_tolerance_keeps_the_first_plan_and_a_negative_one_is_refused():
    """Any plan is within a tolerance of 100 x the lower bound: the search keeps the first setting's plan
    (slack-coupled, longest first, open cap max_open)."""
    specs = random_specs(10, 6, seed=5)
    _, orders = ListScheduler(specs, 3, 3, 6, UNIFORM, "slack-coupled", True).run()
    assert ring_schedule(specs, 3, 3, 6, UNIFORM, tolerance=100.0) == with_p2p(orders, specs)
    with pytest.raises(ScheduleError, match="tolerance"):
        ring_schedule(specs, 3, 3, tolerance=-0.1)
