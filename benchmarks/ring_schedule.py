"""Ring pipeline schedule vs interleaved 1F1B: idle fraction, activation bounds and deadlock checks over a grid.

For each pp x m (micro-batches) x mu_rec, every micro-batch's lap count is the deepest of its sequences' depths
from megaloop.depth's sampler (k = min(laps, ceil(mu_rec / 2)) laps with autograd); the ring schedule for one
optimizer step is generated, then simulated (which fails on a deadlock, a mismatched send/recv or a broken
activation bound). Printed beside its idle fraction:

  target   interleaved 1F1B's (p - 1) / (v m), with v = the full laps (forward + backward) that carry the same work
           as the micro-batches' laps: v = sum_j (n_j f_nograd + k_j (f + b)) / (m (f + b)) (= laps when every lap
           keeps activations). With v = the mean lap count instead ("v/laps" column) no schedule can reach it once
           laps without autograd exist: they cost f, not f + b, while every schedule keeps the (p - 1)(f + b) bubble.
  best     the idle fraction of a schedule at the lower bound (generate.lower_bound); "infeasible" marks rows
           whose lower bound is already above the target (m < pp, or one micro-batch's chain longer than the rest)
  1F1B-i   simulated interleaved 1F1B with v = round(mean laps) chunks, all with autograd (m a multiple of pp),
           and its peak stored activation units on rank 0 (i-mem) beside the ring's on any rank (mem; a unit:
           one lap segment's, the embedding's or the loss's saved activations)
  fly      the ring's peak micro-batches in flight on a rank / the bound; open: its peak open micro-batches
  rdv/as   the same schedule simulated under NCCL's rendezvous semantics as the executor posts it (one group per
           channel direction; simulate(p2p="rendezvous"), which fails on a deadlock), its makespan over the one
           with free sends
  shared   whether the earlier posting (one group per pipeline, each run of Sends and Recvs one batch waited for
           whole; simulate(p2p="shared")) runs or hangs under those semantics

The default bound, 3 x pp micro-batches in flight (6 x pp open), keeps the ring's peak stored units near
interleaved 1F1B's; with --in-flight 2 the ring stores less and a few rows end a little above the target.

Usage (from the repository root):

    python benchmarks/ring_schedule.py                  # the grid pp {2,4,8} x m {4,8,16} x mu_rec {4,8,16}
    python benchmarks/ring_schedule.py --in-flight 2    # bound: 2 * pp micro-batches in flight
    python benchmarks/ring_schedule.py --timing         # generation time per size, as the trainer calls it

--timing generates, per size (pp, m, mu_rec) and spec set, the schedule the trainer asks for every optimizer step
(laps uniform in [mu_rec / 2, 2 mu_rec], grad_laps = min(laps, mu_rec / 2), 3 pp micro-batches in flight, no
restarts) with the generator as first written (tests/pipeline/ring_reference.py) and with pipeline.ring at
tolerance 0 and at its default, side by side, and prints the median over the spec sets of each one's process CPU
time (the best of 3 calls, garbage collector off) and the largest makespan change (simulated); then, for a few
larger sizes, each tolerance's makespan change against tolerance 0. It exits non-zero if tolerance 0 changes a
makespan or a tolerance costs more than itself.
"""
from __future__ import annotations

import argparse
import gc
import math
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaloop.depth import SAMPLERS, make_sampler  # noqa: E402  (after the path set-up)
from pipeline.ring import CostModel, MicroBatch, interleaved_1f1b, ring_schedule, simulate, uniform_specs  # noqa: E402
from pipeline.ring.gantt import gantt_chart  # noqa: E402
from pipeline.ring import DeadlockError, lower_bound  # noqa: E402
from pipeline.ring.generate import TOLERANCE  # noqa: E402
from tests.pipeline.ring_reference import reference_schedule  # noqa: E402

TIMING_SIZES = [(2, 8, 8), (4, 8, 8), (4, 16, 8), (8, 16, 16), (8, 32, 16)]  # (pp, m, mu_rec)
SWEEP_SIZES = [(4, 32, 8), (8, 8, 16), (8, 32, 8), (8, 32, 16)]
SWEEP_TOLERANCES = [0.0, 0.001, TOLERANCE, 0.005, 0.01]

FIGURE = Path(__file__).resolve().parent / "figures" / "ring_schedule.png"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--m", type=int, nargs="+", default=[4, 8, 16], help="micro-batches per step")
    parser.add_argument("--mu-rec", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--sampler", default="poisson-truncated-full", choices=sorted(SAMPLERS))
    parser.add_argument("--sequences", type=int, default=8, help="sequences per micro-batch")
    parser.add_argument("--in-flight", type=int, default=3, help="bound: this many times pp micro-batches in flight")
    parser.add_argument("--restarts", type=int, default=16, help="seeded extra plans while above the lower bound")
    parser.add_argument("--ragged", action="store_true", help="lap costs scaled by the active rows (ragged loop)")
    parser.add_argument("--latency", type=float, default=0.0, help="p2p latency, in forward lap segments")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--gantt", type=Path, default=FIGURE, help="PNG of the ring schedule at --gantt-config")
    parser.add_argument("--gantt-config", type=int, nargs=3, default=[4, 16, 8], metavar=("PP", "M", "MU_REC"))
    parser.add_argument("--timing", action="store_true", help="print the generation time per size and exit")
    parser.add_argument("--timing-seeds", type=int, default=5, help="spec sets per size for --timing")
    return parser.parse_args(argv)


def trainer_specs(m: int, mu_rec: int, seed: int) -> list[MicroBatch]:
    """m micro-batches with laps uniform in [mu_rec / 2, 2 mu_rec] and grad_laps = min(laps, mu_rec / 2)."""
    rng = random.Random(seed)
    laps = [rng.randint(max(1, mu_rec // 2), 2 * mu_rec) for _ in range(m)]
    return [MicroBatch(n, min(n, max(1, mu_rec // 2))) for n in laps]


def cpu_ms(generate, *args, repeat: int = 3, **kwargs) -> tuple[float, list]:
    """(process CPU milliseconds, result) of the fastest of `repeat` calls, with the garbage collector off during
    each (as timeit does: the other jobs of this machine and collections set off by earlier allocations would
    otherwise blur the figures)."""
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        gc.disable()
        try:
            started = time.process_time()
            result = generate(*args, **kwargs)
            best = min(best, time.process_time() - started)
        finally:
            gc.enable()
    return 1000 * best, result


def makespan(schedule, specs: list[MicroBatch], pp: int) -> float:
    return simulate(schedule, specs, CostModel(), max_in_flight=3 * pp, max_open=6 * pp).makespan


def timing(args) -> int:
    """Per size, the generator as first written beside pipeline.ring at tolerance 0 and at its default (median
    CPU ms over the spec sets, and the largest makespan change); then the makespan cost of each tolerance."""
    print(f"generation time per optimizer step, as the trainer asks (process CPU ms, best of 3, median over "
          f"{args.timing_seeds} spec sets; laps uniform in [mu_rec/2, 2 mu_rec], 3 x pp in flight, 6 x pp open)")
    print(f" pp   m   mu  first-written  tolerance 0  tolerance {100 * TOLERANCE:.2f}%  speed-up  "
          f"makespan vs first-written: tolerance 0 / {100 * TOLERANCE:.2f}% (largest change)")
    failed = False
    for pp, m, mu_rec in TIMING_SIZES:
        times, change = ([], [], []), ([], [])
        for seed in range(args.timing_seeds):
            specs = trainer_specs(m, mu_rec, seed)
            old_ms, old = cpu_ms(reference_schedule, specs, pp, 3 * pp, open_first=False)
            exact_ms, exact = cpu_ms(ring_schedule, specs, pp, 3 * pp, tolerance=0.0)
            new_ms, new = cpu_ms(ring_schedule, specs, pp, 3 * pp)
            for column, ms in zip(times, (old_ms, exact_ms, new_ms)):
                column.append(ms)
            reference = makespan(old, specs, pp)
            change[0].append(makespan(exact, specs, pp) / reference - 1.0)
            change[1].append(makespan(new, specs, pp) / reference - 1.0)
        old_ms, exact_ms, new_ms = (statistics.median(column) for column in times)
        failed |= max(map(abs, change[0])) > 1e-12 or max(change[1]) > TOLERANCE + 1e-12
        print(f"{pp:3d} {m:3d} {mu_rec:4d} {old_ms:10.1f} ms {exact_ms:9.1f} ms {new_ms:13.1f} ms "
              f"{old_ms / new_ms:8.1f}x  {100 * max(change[0]):+.3f}% / {100 * max(change[1]):+.3f}%")
    failed |= tolerance_sweep(args)
    return 1 if failed else 0


def tolerance_sweep(args) -> bool:
    """Over 2 x timing-seeds spec sets per size (laps uniform, and depths from the sampler), each tolerance's
    median CPU ms and its makespan change against tolerance 0 (mean, largest); True if one is above its bound."""
    print(f"the search stops at a plan within the tolerance of the lower bound: makespan change against tolerance 0 "
          f"(mean / largest) and median CPU ms, over {2 * args.timing_seeds} spec sets per size")
    print(" pp   m   mu " + "".join(f"{f'tolerance {100 * t:.2f}%':>25}" for t in SWEEP_TOLERANCES))
    failed = False
    for pp, m, mu_rec in SWEEP_SIZES:
        cases = [trainer_specs(m, mu_rec, 100 + seed) for seed in range(args.timing_seeds)]
        cases += [sampled_specs(args, m, mu_rec, seed=100 + seed) for seed in range(args.timing_seeds)]
        cells, exact = [], None
        for tolerance in SWEEP_TOLERANCES:  # tolerance 0 first: the reference makespans
            runs = [cpu_ms(ring_schedule, specs, pp, 3 * pp, tolerance=tolerance) for specs in cases]
            spans = [makespan(schedule, specs, pp) for specs, (_, schedule) in zip(cases, runs)]
            exact = exact or spans
            changes = [span / base - 1.0 for span, base in zip(spans, exact)]
            failed |= max(changes) > tolerance + 1e-12
            cells.append(f"{100 * statistics.mean(changes):+.3f}/{100 * max(changes):+.3f}% "
                         f"{statistics.median(ms for ms, _ in runs):5.1f} ms")
        print(f"{pp:3d} {m:3d} {mu_rec:4d} " + "".join(f"{cell:>25}" for cell in cells))
    return failed


def sampled_specs(args, m: int, mu_rec: int, seed: int | None = None) -> list[MicroBatch]:
    """Per micro-batch: laps = its deepest sequence, k = min(laps, ceil(mu_rec / 2)); with --ragged the active
    fraction of each lap (sequences aligned at their end, so lap l runs those with depth >= laps - l). The
    sampler's seed: `seed`, else --seed."""
    sampler = make_sampler(args.sampler, mu_rec, None, args.seed if seed is None else seed)
    specs = []
    for j in range(m):
        depths = sampler.sample(0, np.arange(j * args.sequences, (j + 1) * args.sequences)).T.numpy()
        laps = int(depths.max())
        active = tuple(float((depths >= laps - lap).mean()) for lap in range(laps)) if args.ragged else ()
        specs.append(MicroBatch(laps, min(laps, math.ceil(mu_rec / 2)), active))
    return specs


def equal_work_laps(specs: list[MicroBatch], costs: CostModel) -> float:
    """v: full laps (f + b each) with the same per-rank work as the micro-batches' laps, averaged over them."""
    work = 0.0
    for spec in specs:
        for lap in range(spec.laps):
            unit = costs.forward + costs.backward if lap >= spec.first_grad_lap else costs.nograd_forward
            work += unit * spec.active_fraction(lap)
    return work / (len(specs) * (costs.forward + costs.backward))


def one_config(args, pp: int, m: int, mu_rec: int, costs: CostModel) -> dict:
    specs = sampled_specs(args, m, mu_rec)
    bound = args.in_flight * pp
    started = time.perf_counter()
    schedule = ring_schedule(specs, pp, bound, 2 * bound, costs, restarts=args.restarts)
    seconds = time.perf_counter() - started
    result = simulate(schedule, specs, costs, max_in_flight=bound, max_open=2 * bound)
    rendezvous = simulate(schedule, specs, costs, max_in_flight=bound, max_open=2 * bound, p2p="rendezvous")
    try:  # the earlier posting (one group per pipeline, a run of Sends and Recvs one batch) under NCCL's semantics
        simulate(schedule, specs, costs, p2p="shared")
        shared = "runs"
    except DeadlockError:
        shared = "hangs"
    v = equal_work_laps(specs, costs)
    busy = sum(result.busy)
    best = 1.0 - busy / (pp * lower_bound(specs, pp, costs))
    row = dict(pp=pp, m=m, mu=mu_rec, laps=float(np.mean([s.laps for s in specs])), v=v, result=result,
               target=(pp - 1) / (v * m), best=best, bound=bound, seconds=seconds, specs=specs,
               rendezvous=rendezvous.makespan / result.makespan, shared=shared)
    row["v_laps"] = (pp - 1) / (row["laps"] * m)
    if m % pp == 0:
        chunks = max(1, round(row["laps"]))
        row["interleaved"] = simulate(interleaved_1f1b(pp, m, chunks), uniform_specs(m, chunks), costs)
    return row


def verdict(row: dict) -> str:
    if row["result"].idle_fraction <= row["target"] + 1e-12:
        return "ok"
    return "infeasible" if row["best"] > row["target"] + 1e-12 else "over"


def print_row(row: dict) -> None:
    result, inter = row["result"], row.get("interleaved")
    inter_text = f"{inter.idle_fraction:7.4f} {inter.peak_stored[0]:5d}" if inter else f"{'-':>7} {'-':>5}"
    print(f"{row['pp']:3d} {row['m']:3d} {row['mu']:4d} {row['laps']:6.2f} {row['v']:6.2f} "
          f"{result.idle_fraction:7.4f} {row['target']:7.4f} {row['best']:7.4f} {verdict(row):>10} "
          f"{row['v_laps']:7.4f} {inter_text} {max(result.peak_stored):5d} "
          f"{max(result.peak_in_flight):3d}/{row['bound']:<3d} {result.peak_open:3d} {row['seconds']:6.2f} "
          f"{row['rendezvous']:6.4f} {row['shared']:>6}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.timing:
        return timing(args)
    costs = CostModel(forward=1.0, backward=2.0, nograd_forward=1.0, latency=args.latency)
    print(f"costs: forward {costs.forward}, backward {costs.backward}, no-autograd forward {costs.nograd_forward}, "
          f"latency {costs.latency}; bound {args.in_flight} x pp micro-batches in flight, 2 x that open; "
          f"{args.sequences} sequences per micro-batch, sampler {args.sampler}{', ragged' if args.ragged else ''}")
    print(" pp   m   mu  laps      v    idle  target    best    verdict  v/laps 1F1B-i i-mem  mem  fly    open  gen_s  rdv/as shared")
    rows = []
    for pp in args.pp:
        for m in args.m:
            for mu_rec in args.mu_rec:
                rows.append(one_config(args, pp, m, mu_rec, costs))
                print_row(rows[-1])
    counts = {name: sum(verdict(r) == name for r in rows) for name in ("ok", "infeasible", "over")}
    print(f"{len(rows)} schedules simulated: all deadlock-free, sends matching recvs, within their activation bounds; "
          f"idle <= target: {counts['ok']}, target below any schedule's lower bound: {counts['infeasible']}, "
          f"above target: {counts['over']}")
    print(f"under NCCL's rendezvous semantics (one group per channel direction): all {len(rows)} deadlock-free, "
          f"makespan / free sends' {min(r['rendezvous'] for r in rows):.4f} .. {max(r['rendezvous'] for r in rows):.4f}"
          f"; the earlier posting (one group per pipeline) hangs in {sum(r['shared'] == 'hangs' for r in rows)} of "
          f"{len(rows)}")
    pp, m, mu_rec = args.gantt_config
    row = next((r for r in rows if (r["pp"], r["m"], r["mu"]) == (pp, m, mu_rec)), None) or one_config(
        args, pp, m, mu_rec, costs)
    args.gantt.parent.mkdir(parents=True, exist_ok=True)
    title = (f"ring schedule, pp={pp}, m={m}, mu_rec={mu_rec}: idle {100 * row['result'].idle_fraction:.2f}% "
             f"(interleaved 1F1B bound {100 * row['target']:.2f}%)")
    path = gantt_chart(row["result"], args.gantt, title)
    print(f"Gantt chart: {path} ({path.stat().st_size // 1024} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
