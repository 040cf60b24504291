"""The ring-pipeline executor's measured idle fraction per rank beside the simulator's prediction from measured costs.

pp CPU processes (gloo, one thread each) run a looped model through the ring schedule of micro-batches of different
lap counts: by default parcae-tiny as `megaloop.model.stages.LoopedStageProgram` stages, one core block each
(`--model parcae`), or the toy of tests/pipeline/test_ring_execute.py, wider (`--model toy`). Before the steps, ranks 0
and 1 bounce messages of 0 to 1 x the run's message size with the executor's batch_isend_irecv (a ping-pong); a
least-squares line through the one-way times gives the message delay a + b x bytes.

Idle has one definition on both sides: per rank, 1 - busy / makespan, the makespan from the first rank's start
(after a barrier) to the last rank's end. Measured, busy is the rank's time outside its waits for receives: each
compute action is charged from its start to the next one's start, less the time spent waiting in
`batch_isend_irecv`'s receives in between, so the executor's bookkeeping and the posting of sends and receives
count as part of the action they follow. Per step, the mean charge of each (rank, action kind) (no-grad forward,
forward, backward, embed, loss and their backwards), the ping-pong's a and b and the message size make the cost
model, with `rendezvous` (below), and `pipeline.ring.simulate` runs the same schedule with it: its per-rank idle
fractions are that step's prediction (a step's load moves all its costs together, so each step is predicted from
its own costs). Acceptance: each rank's median measured idle within 20% (relative) of the median prediction.
Nothing is fitted to the measured idle: the costs are per-kind means, the delay comes from the ping-pong.

Where the earlier gap came from (printed last, "as first compared": busy = compute alone, one latency after the
send measured as how late waiting actions started; 16-36% apart in the runs below and under load):
- Posting. gloo's TCP transport writes a message's payload in the thread that posts the send when the receiver's
  ready notice is already there (and posting otherwise waits for the pair's lock while the transport thread
  writes): alone, posting a 1 MiB send took 0.06 ms before the receive was posted and 0.42 ms after (1.26 ms for
  4 MiB). In the runs the executor's posting and bookkeeping add 7-22% to a lap's compute time on a quiet machine
  (the "mean cost per action" line: charged, and compute alone in brackets), up to 60% under load, time the
  earlier comparison counted as idle.
- Rendezvous. gloo moves a payload only once the receiver has posted its irecv (the sender announces it, the
  receiver answers, the sender's transport thread writes it), so a message sent long before its Recv still takes
  a + b x bytes after the Recv is posted (alone: 0.59 ms for 1 MiB sent 20 ms earlier). `CostModel(rendezvous=True)`
  simulates that; without it the prediction is 0.002-0.008 lower ("without rendezvous").
- What remains is late wake-ups. Half the waits end within 0.3 ms of what the delay model predicts from the measured
  posting times, but about a tenth end more than 2 ms later (together 12-17 ms per step at pp 2: what the simulated
  makespan lacks, 1-5%); traced action by action they come in steps of about 3.8-4 ms, one scheduler tick of the
  machine's kernel (250 Hz), as when the thread that must move a payload wakes on a core that is computing. The
  simulation with each action's own cost instead of the means ("each action's own cost") is nearly as far from the
  measurement as the prediction: the costs are right, the rest is in those waits, which no per-message constant
  captures.

Measured on the project's shared 2-core machine (pp 2, 7 steps, load average 0.7-1.0; medians): parcae-tiny
(256 KiB messages; ping-pong 0.065 ms + 0.140 ms/MB): idle rank 0 simulated 0.390, measured 0.415 (steps
0.383-0.435), 6.0% apart; rank 1 0.188 vs 0.216 (steps 0.170-0.249), 13.0%; all ranks 0.286 vs 0.313, 8.5% (as
first compared 0.309 vs 0.367, 15.9%); one mean per kind for both ranks misses their asymmetry (rank 1: 0.158,
26.8%). The toy (1 MiB messages; 0.083 ms + 0.215 ms/MB): rank 0 0.115 vs 0.137 (steps 0.117-0.162), 16.3%; rank 1
0.249 vs 0.268, 7.3%; all ranks 0.183 vs 0.208, 12.2% (as first compared 0.190 vs 0.257, 26.3%). An earlier
quiet run (load 0.5-0.8) gave parcae-tiny 7.2% and 14.0%, the toy 22.2% (rank 0: 0.119 vs 0.152, OUTSIDE 20%)
and 10.4%; two runs under load (1-minute load 2.3-3.8) the toy's rank 0 10-20% and rank 1 4-12%. The toy's rank
0 has the smallest idle and the widest spread between steps: it sits at the edge of the target, which is why
parcae-tiny, the real model and the steadier measurement, is the default.

The toy computes B e once per micro-batch at Embed so that stage 0's laps cost what the others' do; parcae-tiny's
stage 0 applies the injection in its laps (the per-rank costs take it in).

Usage (from the repository root):

    python benchmarks/ring_execute.py               # parcae-tiny stages, pp 2, 4 micro-batches, 7 measured steps
    python benchmarks/ring_execute.py --model toy   # the toy, width 512
    python benchmarks/ring_execute.py --model toy --pp 4 --width 256
"""
from __future__ import annotations

import argparse
import bisect
import math
import os
import pickle
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import fields, replace
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.ring import CostModel, MicroBatch, rank_of, ring_schedule, simulate  # noqa: E402  (after the path set-up)
from pipeline.ring.actions import Backward, Embed, EmbedBackward, Forward, Loss, LossBackward  # noqa: E402
from pipeline.ring.execute import RingExecutor  # noqa: E402
from pipeline.ring.p2p import neighbours  # noqa: E402
from tests.pipeline.spawn import spawn  # noqa: E402
from tests.pipeline.test_ring_execute import ToyLoop, ToyProgram, batch  # noqa: E402

LAPS = [(6, 2), (3, 2), (8, 3), (5, 2)]  # (laps, laps with autograd) of each micro-batch
SPECS = [MicroBatch(laps, kept) for laps, kept in LAPS]
PING_SIZES = (0.0, 0.125, 0.25, 0.5, 1.0)  # ping-pong message sizes, fractions of the run's message
PING_REPS = 21
SLOW = 0.002  # a message this much later than the delay model predicts counts as a late wake-up


def kind(action) -> str:
    if isinstance(action, Forward):
        return "forward" if action.grad else "nograd_forward"
    return {Backward: "backward", Embed: "embed", EmbedBackward: "embed_backward", Loss: "loss",
            LossBackward: "loss_backward"}[type(action)]


class BalancedProgram(ToyProgram):
    """The toy with B e computed once per micro-batch at Embed (it is the same in every lap), so that stage 0's
    laps cost what the other stages' do: the cost model has one cost per action kind for all ranks."""

    def embed(self, mb):
        e, h0 = super().embed(mb)
        return self.model.inject(e), h0

    def lap_segment(self, mb, lap, h, e):
        if e is not None:
            h = self.model.a * h + e
        return self.model.layers(h, self.first, self.last)


class Replay(CostModel):
    """Each action's own measured cost (one step's) with `base`'s message delay, to tell cost variance from the
    rest."""

    def __init__(self, durations: dict, base: CostModel):
        super().__init__(**{f.name: getattr(base, f.name) for f in fields(base)})
        object.__setattr__(self, "durations", durations)

    def of(self, action, specs):
        return self.durations[action]


class RankCosts(CostModel):
    """The mean cost of each (rank, action kind), per lap with every row active (scaled by a lap's active fraction
    as CostModel does), with `base`'s message delay: the ranks run different code (embedding, injection, loss)."""

    def __init__(self, means: dict, pp: int, base: CostModel):
        super().__init__(**{f.name: getattr(base, f.name) for f in fields(base)})
        object.__setattr__(self, "means", means)
        object.__setattr__(self, "pp", pp)

    def of(self, action, specs):
        return self.means[rank_of(action, self.pp), kind(action)] * fraction(action, specs)


def fraction(action, specs) -> float:
    """The active fraction of a lap action (1 for the others)."""
    return specs[action.mb].active_fraction(action.lap) if isinstance(action, (Forward, Backward)) else 1.0


# the runs ----------------------------------------------------------------------------------------------------------

def toy_program(rank: int, pp: int, args):
    """(the balanced toy's stage, its micro-batch specs, the bytes of a message with every row active)."""
    model = ToyLoop(args.width, layers=pp * args.layers_per_stage, vocab=args.vocab)
    batches = [batch(mb, seq=args.seq, vocab=args.vocab, width=args.width, rows=args.rows)
               for mb in range(len(SPECS))]
    batches = [(ids, labels, h0.float()) for ids, labels, h0 in batches]
    return BalancedProgram(model, rank, pp, len(SPECS), batches), SPECS, args.rows * args.seq * args.width * 4


def parcae_program(rank: int, pp: int, args):
    """(parcae-tiny's stage, fp32, one core block per stage; every micro-batch `rows` sequences of one depth)."""
    from megaloop.config import load_config
    from megaloop.model import build_model
    from megaloop.model.stages import LoopedStageProgram, StageMicroBatch

    config = Path(__file__).resolve().parents[1] / "configs" / "parcae-tiny.yaml"
    cfg = load_config(config, [f"model.n_core={pp}", f"model.seq_len={args.seq}"]).model
    model = build_model(cfg, seed=0)
    batches = []
    for mb, (laps, kept) in enumerate(LAPS):
        gen = torch.Generator().manual_seed(100 + mb)
        ids = torch.randint(cfg.vocab_size, (args.rows, cfg.seq_len), generator=gen)
        index = torch.arange(mb * args.rows, (mb + 1) * args.rows)
        batches.append(StageMicroBatch(ids, ids.clone(), laps, kept, (0, 0, index)))
    program = LoopedStageProgram(model, rank, pp, batches, 1 / len(batches))
    specs = [MicroBatch(**spec) for spec in program.specs()]
    return program, specs, math.prod(program.message_shape(0, 0)) * 4


def ping_pong(rank: int, message_bytes: int) -> list[tuple[int, float]]:
    """Ranks 0 and 1 bounce a float32 tensor of each PING_SIZES size, each way one batch_isend_irecv as the
    executor posts it, PING_REPS times after two warm-ups, the sizes taking turns (a burst of load hits them all
    alike); rank 0 returns (bytes, median one-way seconds) per size."""
    tensors = [torch.zeros(max(1, int(fraction * message_bytes) // 4)) for fraction in PING_SIZES]
    ops = [(dist.isend, 1), (dist.irecv, 1)] if rank == 0 else [(dist.irecv, 0), (dist.isend, 0)]
    one_way = defaultdict(list)
    for rep in range(PING_REPS + 2):
        for tensor in tensors:
            dist.barrier()
            start = time.perf_counter()
            for op, peer in ops if rank <= 1 else []:
                dist.batch_isend_irecv([dist.P2POp(op, tensor, peer)])[0].wait()
            if rep >= 2:
                one_way[tensor.numel() * 4].append((time.perf_counter() - start) / 2)
    return [(n, statistics.median(times)) for n, times in one_way.items()]


def worker(rank, pp, args, out):
    dist.init_process_group("gloo")
    program, specs, message_bytes = (parcae_program if args.model == "parcae" else toy_program)(rank, pp, args)
    pings = ping_pong(rank, message_bytes)
    actions = ring_schedule(specs, pp, max_in_flight=args.in_flight)[rank]
    executor = RingExecutor(program, dtype=torch.float32)
    steps = []
    for _ in range(args.steps + 1):  # the first step warms up
        dist.barrier()
        start = time.perf_counter()
        result = executor.run(actions, specs)
        steps.append((start, time.perf_counter(), result.timings, result.posts, result.recvs))
    Path(f"{out}.{rank}").write_bytes(pickle.dumps((steps[1:], pings, specs, message_bytes)))


# the analysis ------------------------------------------------------------------------------------------------------

def action_costs(timings: list, posts: list) -> tuple[list, float]:
    """(each compute action's (action, cost), the rank's total wait): an action is charged from its start to the
    next action's start (the last: to the end of its rank's last batch), less the waits for receives (posted to
    done of each batch_isend_irecv) in between. Batches before the first action (waiting for its input) are idle."""
    costs, waited = [], 0.0
    j = bisect.bisect_left([t for t, _, _ in posts], timings[0][1]) if timings else 0
    for i, (action, start, end) in enumerate(timings):
        stop = timings[i + 1][1] if i + 1 < len(timings) else max([end] + [done for _, _, done in posts[j:]])
        wait = 0.0
        while j < len(posts) and posts[j][0] < stop:
            wait += posts[j][2] - posts[j][1]
            j += 1
        costs.append((action, stop - start - wait))
        waited += wait
    return costs, waited


def receiving_batches(step: list, rank: int, pp: int, specs, costs: CostModel) -> list[tuple[float, float, float]]:
    """Per batch_isend_irecv of `rank` with receives: (posted, done, the arrival the cost model predicts from the
    measured posting times, i.e. the latest of its messages' max(sender's posting, this rank's posting) + delay)."""
    posts = step[rank][3]
    starts = [p[0] for p in posts]
    latest: dict[int, float] = {}
    for message, building, _ in step[rank][4]:
        index = bisect.bisect_left(starts, building)
        producer = message.producer
        sender = step[rank_of(producer, pp)]
        end = next(t1 for action, _, t1 in sender[2] if action == producer)
        sent = sender[3][bisect.bisect_left([p[0] for p in sender[3]], end)][1]
        arrival = max(sent, posts[index][1]) + costs.delay(message, specs)
        latest[index] = max(latest.get(index, -math.inf), arrival)
    return [(posts[i][1], posts[i][2], arrival) for i, arrival in sorted(latest.items())]


def predicted_waits(batches: list) -> float:
    """The waits for receives the cost model predicts from the measured posting times."""
    return sum(max(0.0, arrival - posted) for posted, _, arrival in batches)


def late_arrivals(batches: list) -> list[float]:
    """How much later than predicted each batch that waited completed."""
    return [done - arrival for posted, done, arrival in batches if arrival > posted]


def fit_delay(pings: list) -> tuple[float, float]:
    """(a, b) of the least-squares line one-way time = a + b x bytes through the ping-pong's medians."""
    b, a = statistics.linear_regression([n for n, _ in pings], [t for _, t in pings])
    return max(a, 0.0), max(b, 0.0)


def within(measured: float, simulated: float) -> str:
    gap = abs(simulated - measured) / measured if measured else math.inf
    return f"{gap:.1%} ({'within' if gap <= 0.2 else 'OUTSIDE'} 20%)"


def ms(values) -> str:
    return ", ".join(f"{v * 1e3:.1f}" for v in values)


def fractions(values) -> str:
    return ", ".join(f"{v:.3f}" for v in values)


def measure(step: list) -> dict:
    """One step's measured figures: makespan, per rank busy (charged costs), compute alone, posting time, waits
    and idle fraction, and every action's charged cost."""
    start, end = min(r[0] for r in step), max(r[1] for r in step)
    charged = [action_costs(r[2], r[3]) for r in step]
    busy = [sum(c for _, c in costs) for costs, _ in charged]
    return {"makespan": end - start, "busy": busy, "waits": [w for _, w in charged],
            "compute": [sum(t1 - t0 for _, t0, t1 in r[2]) for r in step],
            "posting": [sum(p - t for t, p, _ in r[3]) for r in step],
            "idle": [1.0 - b / (end - start) for b in busy], "overall": 1.0 - sum(busy) / (len(step) * (end - start)),
            "costs": {action: cost for costs, _ in charged for action, cost in costs}}


def cost_models(own: dict, specs, pp: int, a: float, b: float, message_bytes: int) -> tuple[CostModel, RankCosts]:
    """(the mean charged cost of each action kind over all ranks, of each (rank, kind)), per lap with every row
    active; the ping-pong's delay; rendezvous."""
    by_kind, by_rank = defaultdict(list), defaultdict(list)
    for action, cost in own.items():
        by_kind[kind(action)].append(cost / fraction(action, specs))
        by_rank[rank_of(action, pp), kind(action)].append(cost / fraction(action, specs))
    means = {name: statistics.fmean(values) for name, values in by_kind.items()}
    pooled = CostModel(**means, latency=a, latency_per_byte=b, message_bytes=message_bytes, rendezvous=True)
    return pooled, RankCosts({key: statistics.fmean(values) for key, values in by_rank.items()}, pp, pooled)


VARIANTS = {  # the simulations of each step: name -> cost model from (pooled per kind, per rank and kind, own costs)
    "mean cost per rank and kind": lambda pooled, ranked, own: ranked,
    "mean cost per kind, all ranks alike": lambda pooled, ranked, own: pooled,
    "mean cost per kind, without rendezvous (a message arrives its delay after its Send)":
        lambda pooled, ranked, own: replace(pooled, rendezvous=False),
    "each action's own cost": lambda pooled, ranked, own: Replay(own, pooled),
}


def compare(ranks: list, schedule: list, pp: int) -> None:
    """Per step, the measured idle per rank and the simulations of VARIANTS from that step's charged costs (a
    step's load moves all its costs together, so each step is predicted from its own); then the medians over the
    steps, and the diagnostics of the module docstring."""
    _, pings, specs, message_bytes = ranks[0]
    a, b = fit_delay(pings)
    print(f"ping-pong one-way (median of {PING_REPS}): " +
          ", ".join(f"{n / 1024:.0f} KiB {t * 1e3:.3f} ms" for n, t in pings) +
          f"; fit {a * 1e3:.3f} ms + {b * 1e9:.3f} ms/MB; the run's messages {message_bytes / 1024:.0f} KiB")
    steps = [[r[0][s] for r in ranks] for s in range(len(ranks[0][0]))]
    measured, simulated, late = [], defaultdict(list), []
    for s, step in enumerate(steps):
        got = measure(step)
        pooled, ranked = cost_models(got["costs"], specs, pp, a, b, message_bytes)
        for name, model in VARIANTS.items():
            simulated[name].append(simulate(schedule, specs, model(pooled, ranked, got["costs"])))
        measured.append(got)
        batches = [receiving_batches(step, r, pp, specs, pooled) for r in range(pp)]
        late += [x for per_rank in batches for x in late_arrivals(per_rank)]
        sim = simulated[next(iter(simulated))][-1]
        print(f"step {s}: makespan {got['makespan'] * 1e3:.1f} ms (simulated {sim.makespan * 1e3:.1f}); per rank: "
              f"busy {ms(got['busy'])} ms (simulated {ms(sim.busy)}; compute alone {ms(got['compute'])}, posting "
              f"{ms(got['posting'])}), waits {ms(got['waits'])} ms (the delay model on the measured posting times "
              f"{ms(predicted_waits(per_rank) for per_rank in batches)}); idle "
              f"{fractions(got['idle'])} (simulated {fractions(sim.idle_fractions)})")
    print_costs(steps, measured)
    slow = [x for x in late if x > SLOW]
    print(f"batches that waited completed later than the delay model predicts by (ms): median "
          f"{statistics.median(late) * 1e3:.3f}, quartiles {ms(statistics.quantiles(late, n=4)[::2])}; "
          f"{len(slow)} of {len(late)} more than {SLOW * 1e3:.0f} ms late, by {sum(slow) / len(steps) * 1e3:.1f} ms "
          f"per step in all")
    for i, (name, sims) in enumerate(simulated.items()):
        print(f"simulated with the {name}:" if i == 0 else f"with the {name}:")
        for rank in range(pp):
            report(f"  rank {rank}", [m["idle"][rank] for m in measured], [sim.idle_fractions[rank] for sim in sims])
        report("  all ranks", [m["overall"] for m in measured], [sim.idle_fraction for sim in sims])
    earlier(steps, schedule, specs, pp)


def print_costs(steps: list, measured: list) -> None:
    charged, alone = defaultdict(list), defaultdict(list)
    for step, got in zip(steps, measured):
        for action, cost in got["costs"].items():
            charged[kind(action)].append(cost)
        for r in step:
            for action, t0, t1 in r[2]:
                alone[kind(action)].append(t1 - t0)
    print("mean cost per action (ms), charged (compute alone): " + ", ".join(
        f"{k} {statistics.fmean(v) * 1e3:.2f} ({statistics.fmean(alone[k]) * 1e3:.2f})"
        for k, v in sorted(charged.items())))


def report(name: str, measured: list, simulated: list) -> None:
    got, want = statistics.median(measured), statistics.median(simulated)
    print(f"{name} idle fraction: simulated {want:.3f}, measured {got:.3f} (medians; measured steps "
          f"{min(measured):.3f}-{max(measured):.3f}); relative difference {within(got, want)}")


def earlier(steps: list, schedule: list, specs, pp: int) -> None:
    """The comparison as first made: busy = compute actions alone, their mean durations, one latency after the
    send (the mean of how late actions that waited for a message started), no rendezvous."""
    before, _ = neighbours(specs, pp)
    durations, latencies, overall = defaultdict(list), [], []
    for step in steps:
        start, end = min(r[0] for r in step), max(r[1] for r in step)
        ends = {action: t1 for r in step for action, _, t1 in r[2]}
        busy = 0.0
        for rank, r in enumerate(step):
            previous = r[0]
            for action, t0, t1 in r[2]:
                durations[kind(action)].append(t1 - t0)
                busy += t1 - t0
                producer = before.get(action)
                if producer is not None and rank_of(producer, pp) != rank and ends[producer] > previous:
                    latencies.append(t0 - ends[producer])
                previous = t1
        overall.append(1.0 - busy / (pp * (end - start)))
    means = {name: statistics.fmean(values) for name, values in durations.items()}
    sim = simulate(schedule, specs, CostModel(**means, latency=statistics.fmean(latencies) if latencies else 0.0))
    got = statistics.median(overall)
    print(f"as first compared (compute alone, one latency after the send, no rendezvous): simulated "
          f"{sim.idle_fraction:.3f}, measured median {got:.3f}; relative difference {within(got, sim.idle_fraction)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("toy", "parcae"), default="parcae")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--width", type=int, default=512, help="toy only")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512, help="toy only")
    parser.add_argument("--layers-per-stage", type=int, default=2, help="toy only (parcae: one core block)")
    parser.add_argument("--in-flight", type=int, default=2)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "times")
        spawn(worker, args.pp, args, out)
        ranks = [pickle.loads(Path(f"{out}.{rank}").read_bytes()) for rank in range(args.pp)]
    specs = ranks[0][2]
    print(f"{args.model}, pp={args.pp}, micro-batches (laps, kept) {[(s.laps, s.grad_laps) for s in specs]}, "
          f"{args.rows} x {args.seq} tokens; load average {load:.2f} before, {os.getloadavg()[0]:.2f} after, on "
          f"{os.cpu_count()} cores")
    compare(ranks, ring_schedule(specs, args.pp, max_in_flight=args.in_flight), args.pp)


if __name__ == "__main__":
    main()
