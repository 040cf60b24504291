"""The ring-pipeline executor's measured idle fraction beside the simulator's prediction from measured costs.

pp CPU processes (gloo, one thread each) run the toy looped model of tests/pipeline/test_ring_execute.py, wider,
through the ring schedule of micro-batches of different lap counts. Every rank records each compute action's wall
time; per step the measured idle fraction is 1 - sum(busy) / (pp x makespan), the makespan from the first rank's
start (after a barrier) to the last rank's end. The mean cost of each action kind (no-grad forward, forward,
backward, embed, loss and their backwards; over all ranks and steps) and the mean message latency (how long after
its producer ended an action that waited for a message started) become a `CostModel`, and `pipeline.ring.simulate`
runs the same schedule with it: its idle fraction is the prediction. Acceptance: within 20% of the measured one
(relative). The toy computes B e once per micro-batch at Embed so that stage 0's laps cost what the others' do (the
cost model has one cost per action kind for all ranks). Printed beside: the simulation with each step's own action
durations (cost variance vs means) and each rank's "late starts", the time actions started after both their rank
and their message were ready: gloo's delivery of the ~1 MB messages and process wake-ups, which a single latency
does not capture and which is what remains between the simulated and measured idle fractions.

The machine the project is developed on has 2 cores shared by several people: a step's wall time swings with
their load (the load average is printed), so several steps are printed (their spread is the noise) and the
comparison uses their median. Measured there (pp 2, defaults): idle fraction simulated 0.19, measured 0.25
(steps 0.243-0.251, load 1.2): 22% apart, just outside the 20% target; under heavier load (1.7-2.5) the measured
one rose to 0.25-0.31 (28-44% apart), and with 8 layers per stage it was 0.167 against 0.127 (24%): the extra is
in the late starts, while the simulation with each action's own duration stays near the one with the means. With
async sends waited for right after posting, the run deadlocks: sends must stay in flight.

Usage (from the repository root):

    python benchmarks/ring_execute.py                 # pp 2, 4 micro-batches, width 512, 3 measured steps
    python benchmarks/ring_execute.py --pp 4 --steps 5
"""
from __future__ import annotations

import argparse
import os
import pickle
import statistics
import sys
import tempfile
import time
from collections import defaultdict
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

SPECS = [MicroBatch(6, 2), MicroBatch(3, 2), MicroBatch(8, 3), MicroBatch(5, 2)]


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
    """Each action's own measured duration (one step's), to tell cost variance from executor overhead."""

    def __init__(self, durations: dict, latency: float):
        super().__init__(latency=latency)
        object.__setattr__(self, "durations", durations)

    def of(self, action, specs):
        return self.durations[action]


def late_starts(step, ends: dict, rank: int, pp: int) -> list[tuple[float, bool]]:
    """For each compute action of this rank: how long after it could start (this rank's previous action ended, and
    the message it needs was computed on its rank) it started, and whether it waited for that message (its producer
    ended after this rank's previous action) - the latter's mean is the cost model's message latency."""
    before, _ = neighbours(SPECS, pp)
    previous, out = step[0], []
    for action, start, end in step[2]:
        producer = before.get(action)
        remote = producer is not None and rank_of(producer, pp) != rank
        ready = max(previous, ends[producer]) if remote else previous
        out.append((start - ready, remote and ends[producer] > previous))
        previous = end
    return out


def worker(rank, pp, args, out):
    dist.init_process_group("gloo")
    model = ToyLoop(args.width, layers=pp * args.layers_per_stage, vocab=args.vocab)
    batches = [batch(mb, seq=args.seq, vocab=args.vocab, width=args.width, rows=args.rows)
               for mb in range(len(SPECS))]
    batches = [(ids, labels, h0.float()) for ids, labels, h0 in batches]
    program = BalancedProgram(model, rank, pp, len(SPECS), batches)
    actions = ring_schedule(SPECS, pp, max_in_flight=args.in_flight)[rank]
    executor = RingExecutor(program, dtype=torch.float32)
    steps = []
    for _ in range(args.steps + 1):  # the first step warms up
        dist.barrier()
        start = time.perf_counter()
        result = executor.run(actions, SPECS)
        steps.append((start, time.perf_counter(), result.timings, result.recvs))
    Path(f"{out}.{rank}").write_bytes(pickle.dumps(steps[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--layers-per-stage", type=int, default=2)
    parser.add_argument("--in-flight", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "times")
        spawn(worker, args.pp, args, out)
        ranks = [pickle.loads(Path(f"{out}.{rank}").read_bytes()) for rank in range(args.pp)]
    print(f"pp={args.pp}, micro-batches (laps, kept) {[(s.laps, s.grad_laps) for s in SPECS]}, width {args.width}, "
          f"{args.rows} x {args.seq} tokens, {args.layers_per_stage} layers per stage, load average "
          f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    compare(ranks, ring_schedule(SPECS, args.pp, max_in_flight=args.in_flight), args.pp)


def compare(ranks: list, schedule: list, pp: int) -> None:
    """Prints each step's measured idle fraction and the simulated one from the mean measured costs."""
    durations, latencies, measured, replays = defaultdict(list), [], [], []
    for step in range(len(ranks[0])):
        start, end = min(r[step][0] for r in ranks), max(r[step][1] for r in ranks)
        busy = [sum(t1 - t0 for _, t0, t1 in r[step][2]) for r in ranks]
        ends = {action: t1 for r in ranks for action, _, t1 in r[step][2]}
        for r in ranks:
            for action, t0, t1 in r[step][2]:
                durations[kind(action)].append(t1 - t0)
        late = [late_starts(r[step], ends, rank, pp) for rank, r in enumerate(ranks)]
        latencies += [delay for per_rank in late for delay, waited in per_rank if waited]
        measured.append(1.0 - sum(busy) / (pp * (end - start)))
        replays.append({action: t1 - t0 for r in ranks for action, t0, t1 in r[step][2]})
        print(f"step {step}: makespan {end - start:.3f} s, busy per rank {[round(b, 3) for b in busy]} s, "
              f"measured idle fraction {measured[-1]:.3f}; late starts per rank "
              f"{[round(sum(d for d, _ in per_rank), 3) for per_rank in late]} s")
    means = {name: statistics.fmean(values) for name, values in durations.items()}
    means["latency"] = statistics.fmean(latencies) if latencies else 0.0
    print("mean action costs (ms): " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in sorted(means.items())) +
          f" (latency over {len(latencies)} actions that waited for a message)")
    predicted = simulate(schedule, SPECS, CostModel(**means)).idle_fraction
    replayed = [simulate(schedule, SPECS, Replay(own, means["latency"])).idle_fraction for own in replays]
    print(f"simulated with each step's own action durations instead of the means: "
          f"{', '.join(f'{r:.3f}' for r in replayed)}")
    median = statistics.median(measured)
    gap = abs(predicted - median) / median
    print(f"idle fraction: simulated {predicted:.3f}, measured median {median:.3f} (steps {min(measured):.3f}-"
          f"{max(measured):.3f}); relative difference {gap:.1%} ({'within' if gap <= 0.2 else 'OUTSIDE'} 20%)")


if __name__ == "__main__":
    main()
