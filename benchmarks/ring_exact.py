"""Exact least makespan of a ring schedule by branch and bound, to tell how far the generator is from optimal.

The problem: one chain of compute actions per micro-batch (pipeline.ring.actions.chain); each action runs on its
rank (rank_of), starts after its chain predecessor ends (plus the cost model's latency between ranks), a rank runs
one action at a time, and the makespan is the last end. The memory bounds (micro-batches in flight, open) are left
out, so the optimum here is at most the optimum under them: a generated schedule whose makespan equals it is
optimal under any bound.

The search enumerates active schedules (Giffler and Thompson), which contain an optimal one: at each node, of the
chains' next actions the one that can end soonest fixes a rank and an end time C*; every next action on that rank
that can start before C* is a branch (placed at its earliest start). A node is cut when its lower bound is not
below the best makespan found so far (at first the generator's): the largest, over chains, of the next action's
earliest start plus the rest of the chain, and over ranks, of the earliest time the rank can start its remaining
work plus that work plus the least chain time after its last action there. Explored states (next action, ready time
per chain; free time per rank) are remembered, since other branch orders reach them again. Zero-cost actions
(embedding, loss by default) follow an action of their chain on the same rank: each is placed right after it, which
costs nothing (a zero-cost action after another rank's is refused). With --non-delay the branches are only the
actions that can start soonest on the rank that can start one soonest: the best schedule where no rank idles while
it could start an action, the kind list scheduling (the generator) makes.

The search ends at a schedule as short as `generate.lower_bound`, or when the tree is exhausted (the best found is
then proven optimal), or at the time limit (then only "best found" and the lower bound are known). A schedule it
finds is checked with pipeline.ring.simulate on its per-rank orders (Sends and Recvs added by with_p2p).

For one case (not --grid) it also prints the best schedule's per-rank orders, and which single changed choice of the
critical-path list schedule (longest remaining chain first) would shorten that schedule (`one_change`).

Usage (from the repository root):

    python benchmarks/ring_exact.py                        # pp 4, m 4, mu_rec 8 of ring_schedule.py's grid
    python benchmarks/ring_exact.py --pp 2 --m 8 --mu-rec 4 --time-limit 30
    python benchmarks/ring_exact.py --grid --time-limit 20 # every case of ring_schedule.py's default grid
    python benchmarks/ring_exact.py --non-delay            # only schedules that never idle a rank needlessly
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.ring import CostModel, MicroBatch, lower_bound, ring_orders, simulate, with_p2p  # noqa: E402
from pipeline.ring.actions import Compute, label  # noqa: E402
from pipeline.ring.list_scheduler import Chains  # noqa: E402

EPS = 1e-9
_CHECK_EVERY = 2048  # nodes between looks at the clock
_MEMO_LIMIT = 1_000_000  # explored states remembered at most (about 0.5 GB)


class _OutOfTime(Exception):
    pass


@dataclass
class ExactResult:
    """best: the shortest makespan found; proven: no schedule is shorter (tree exhausted or best at lower_bound);
    orders: its per-rank compute orders; nodes: search nodes visited; seconds: wall time of the search."""

    best: float
    proven: bool
    orders: list[list[Compute]]
    nodes: int
    seconds: float
    bound: float
    improved: bool = False  # the search found a schedule shorter than the incumbent it started from


@dataclass
class _Chain:
    """One micro-batch's chain reduced to its actions of positive cost: per action k its rank, duration, the delay
    before the next one (`lag`), the time from its start to the chain's end (`rem`), the zero-cost actions placed
    right after it (`trail`); per k and rank, the work left there from k on (`work`) and the chain time from the
    start of k to the start of its first action there at or after k (`head`, None: none left); per rank the chain
    time after its last action there (`foot`)."""

    rank: list[int]
    dur: list[float]
    lag: list[float]
    rem: list[float]
    trail: list[list[Compute]]
    lead: list[Compute]
    work: list[list[float]] = field(default_factory=list)
    head: list[list[float | None]] = field(default_factory=list)
    foot: list[float] = field(default_factory=list)


def _reduce(actions, ranks, durations, hops, pp: int) -> _Chain:
    """The `_Chain` of one chain (see Chains), zero-cost actions folded into the action before them."""
    kept = [i for i, d in enumerate(durations) if d > 0]
    for z in range(1, len(actions)):
        if durations[z] == 0 and (ranks[z] != ranks[z - 1] or hops[z - 1]):
            raise ValueError(f"{label(actions[z])} costs nothing but follows {label(actions[z - 1])} on another "
                             f"rank: give it a positive cost (the search places zero-cost actions right after their "
                             f"chain predecessor on its rank)")
    lead = list(actions[:kept[0]]) if kept else list(actions)
    trail, lag = [], []
    for n, i in enumerate(kept):
        end = kept[n + 1] if n + 1 < len(kept) else len(actions)
        trail.append(list(actions[i + 1:end]))
        lag.append(hops[end - 1] if end < len(actions) else 0.0)
    c = _Chain([ranks[i] for i in kept], [durations[i] for i in kept], lag, [0.0] * (len(kept) + 1), trail, lead)
    for k in reversed(range(len(kept))):
        c.rem[k] = c.dur[k] + c.lag[k] + c.rem[k + 1]
    _suffixes(c, pp)
    return c


def _suffixes(c: _Chain, pp: int) -> None:
    n = len(c.rank)
    c.work = [[0.0] * pp for _ in range(n + 1)]
    c.head = [[None] * pp for _ in range(n + 1)]
    c.foot = [0.0] * pp
    for k in reversed(range(n)):
        c.work[k] = list(c.work[k + 1])
        c.work[k][c.rank[k]] += c.dur[k]
        c.head[k] = [None if h is None else h + c.dur[k] + c.lag[k] for h in c.head[k + 1]]
        c.head[k][c.rank[k]] = 0.0
    for r in range(pp):
        last = max((k for k in range(n) if c.rank[k] == r), default=None)
        c.foot[r] = 0.0 if last is None else c.lag[last] + c.rem[last + 1]


class _Search:
    """Depth-first branch and bound over active schedules (see the module docstring)."""

    def __init__(self, specs: Sequence[MicroBatch], pp: int, costs: CostModel, non_delay: bool = False):
        ch = Chains(specs, pp, costs)
        self.pp, self.non_delay = pp, non_delay
        self.chains = [_reduce(*args, pp) for args in zip(ch.actions, ch.ranks, ch.durations, ch.hops)]
        self.actions = ch.actions
        self.kept = [[i for i, d in enumerate(ds) if d > 0] for ds in ch.durations]
        self.idx = [0] * len(self.chains)
        # zero-cost actions before a chain's first costly one (all on its first rank) run at 0, first there
        self.ready = [hops[kept[0] - 1] if kept and kept[0] else 0.0 for hops, kept in zip(ch.hops, self.kept)]
        self.free = [0.0] * pp
        self.orders: list[list[Compute]] = [[] for _ in range(pp)]
        for c, ranks in zip(self.chains, ch.ranks):
            self.orders[ranks[0]].extend(c.lead)
        self.nodes, self.failed = 0, set()

    def bound(self) -> float:
        """A makespan no completion of the current partial schedule can beat."""
        best, free, pp = max(self.free), self.free, self.pp
        start, work, foot = list(free), [0.0] * pp, [float("inf")] * pp
        earliest = [float("inf")] * pp
        for c, k, ready in zip(self.chains, self.idx, self.ready):
            if k == len(c.rank):
                continue
            best = max(best, max(ready, free[c.rank[k]]) + c.rem[k])
            for r, (w, h) in enumerate(zip(c.work[k], c.head[k])):
                if h is not None:
                    work[r] += w
                    earliest[r] = min(earliest[r], ready + h)
                    foot[r] = min(foot[r], c.foot[r])
        for r in range(pp):
            if work[r]:
                best = max(best, max(start[r], earliest[r]) + work[r] + foot[r])
        return best

    def branches(self) -> list[tuple[int, float]]:
        """(chain, start) of each action the active-schedule rule may place next, longest remaining chain first;
        with `non_delay`, of each action that can start soonest on the rank that can start one soonest."""
        options = []
        for j, (c, k) in enumerate(zip(self.chains, self.idx)):
            if k < len(c.rank):
                est = max(self.ready[j], self.free[c.rank[k]])
                options.append((est + c.dur[k], j, est))
        if not options:
            return []
        if self.non_delay:
            end, j_star = min((est, j) for _, j, est in options)
            end += 2 * EPS  # the actions starting at that time
        else:
            end, j_star, _ = min(options)
        rank = self.chains[j_star].rank[self.idx[j_star]]
        picked = [(j, est) for _, j, est in options
                  if self.chains[j].rank[self.idx[j]] == rank and est < end - EPS]
        return sorted(picked, key=lambda je: -self.chains[je[0]].rem[self.idx[je[0]]])

    def place(self, j: int, start: float):
        """Places chain j's next action at `start`; returns what `undo` needs."""
        c, k = self.chains[j], self.idx[j]
        r = c.rank[k]
        saved = (j, self.ready[j], self.free[r], len(self.orders[r]))
        self.orders[r].append(self.actions[j][self.kept[j][k]])
        self.orders[r].extend(c.trail[k])
        self.free[r] = start + c.dur[k]
        self.ready[j] = start + c.dur[k] + c.lag[k]
        self.idx[j] = k + 1
        return saved

    def undo(self, saved) -> None:
        j, ready, free, length = saved
        self.idx[j] -= 1
        r = self.chains[j].rank[self.idx[j]]
        self.ready[j], self.free[r] = ready, free
        del self.orders[r][length:]

    def key(self) -> tuple:
        """The state that fixes every completion: next action and ready time per chain, free time per rank."""
        return tuple(self.idx), tuple(self.ready), tuple(self.free)


def solve(specs: Sequence[MicroBatch], pp: int, costs: CostModel = CostModel(), incumbent: float = float("inf"),
          incumbent_orders: list[list[Compute]] | None = None, time_limit: float = 60.0,
          target: float | None = None, non_delay: bool = False) -> ExactResult:
    """The least makespan of the chains of `specs` on a ring of `pp` ranks (see the module docstring), searching
    below `incumbent` (a makespan already reached by `incumbent_orders`); stops at `target` (a makespan good
    enough; then not proven unless at the lower bound) or after `time_limit` seconds (likewise). With `non_delay`
    only schedules where no rank idles while one of its actions could start are searched (what list scheduling
    makes): the least makespan among those."""
    search = _Search(specs, pp, costs, non_delay)
    floor = lower_bound(specs, pp, costs)
    state = {"best": incumbent, "orders": incumbent_orders, "improved": False}
    stop = floor if target is None else max(floor, target)
    started = time.monotonic()
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 4 * sum(len(c.rank) for c in search.chains) + 1000))
    stopped = state["best"] <= stop + EPS  # nothing to search for
    if not stopped:
        try:
            stopped = _dfs(search, state, stop, started + time_limit)
        except _OutOfTime:
            stopped = True
    proven = state["best"] <= floor + EPS or not stopped
    return ExactResult(state["best"], proven, state["orders"], search.nodes, time.monotonic() - started, floor,
                       state["improved"])


def _dfs(search: _Search, state: dict, stop: float, deadline: float) -> bool:
    """Explores the current node; True once the best is at `stop` (search over)."""
    search.nodes += 1
    if search.nodes % _CHECK_EVERY == 0 and time.monotonic() > deadline:
        raise _OutOfTime
    options = search.branches()
    if not options:
        makespan = max(search.free)
        if makespan < state["best"] - EPS:
            state.update(best=makespan, orders=[list(o) for o in search.orders], improved=True)
        return state["best"] <= stop + EPS
    for j, start in options:
        saved = search.place(j, start)
        try:
            if search.bound() < state["best"] - EPS:
                key = search.key()
                if key not in search.failed:
                    if _dfs(search, state, stop, deadline):
                        return True
                    if len(search.failed) < _MEMO_LIMIT:
                        search.failed.add(key)
        finally:
            search.undo(saved)
    return False


def verify(orders: list[list[Compute]], specs: Sequence[MicroBatch], costs: CostModel) -> float:
    """The simulated makespan of per-rank compute `orders` (Sends and Recvs added); raises if they cannot run."""
    return simulate(with_p2p(orders, specs), specs, costs).makespan


def generated(specs: Sequence[MicroBatch], pp: int, costs: CostModel, in_flight: int, restarts: int):
    """(makespan, per-rank orders) of the generator's schedule, as benchmarks/ring_schedule.py makes it."""
    bound = in_flight * pp
    orders = ring_orders(specs, pp, bound, 2 * bound, costs, restarts=restarts)
    return verify(orders, specs, costs), orders


def one_change(specs: Sequence[MicroBatch], pp: int, costs: CostModel) -> tuple[float, list, list[tuple]]:
    """The critical-path list schedule (no rank idles while an action is ready; of the ready ones, the longest
    remaining chain first, ties to the lower micro-batch) and the changes of one of its choices that shorten it:
    (its makespan, its per-rank orders, [(time, rank, action taken instead, action passed over, makespan)]), every
    later choice still by the rule."""
    search = _Search(specs, pp, costs, non_delay=True)
    base, choices = _follow(search, None)
    better = []
    for point, ready in enumerate(choices):
        for alternative in range(1, ready):
            span, trace = _follow(_Search(specs, pp, costs, non_delay=True), (point, alternative))
            if span < base - EPS:
                better.append(trace + (span,))
    return base, search.orders, better


def _follow(search: _Search, change: tuple[int, int] | None):
    """Places every action by the critical-path rule except, with `change` (point, k), the k-th ranked action at
    the point-th choice between several; (makespan, ready actions per such choice) or, with `change`, (makespan,
    (time, rank, taken, passed over))."""
    choices, trace = [], None
    while True:
        options = search.branches()
        if not options:
            return max(search.free), (choices if change is None else trace)
        pick = 0
        if len(options) > 1:
            if change is not None and len(choices) == change[0]:
                pick = min(change[1], len(options) - 1)
                (j, start), (passed, _) = options[pick], options[0]
                trace = (start, search.chains[j].rank[search.idx[j]], _next_label(search, j),
                         _next_label(search, passed))
            choices.append(len(options))
        search.place(*options[pick])


def _next_label(search: _Search, j: int) -> str:
    return label(search.actions[j][search.kept[j][search.idx[j]]])


def positive(text: str) -> int:
    """An argparse type: an integer >= 1 (anything else is a usage error, exit 2)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", type=positive, default=4, help="ring ranks")
    parser.add_argument("--m", type=positive, default=4, help="micro-batches")
    parser.add_argument("--mu-rec", type=positive, default=8, help="mean recurrence of the depth sampler")
    parser.add_argument("--seed", type=int, default=0, help="the depth sampler's seed (ring_schedule.py's --seed)")
    parser.add_argument("--time-limit", type=float, default=120.0, help="seconds of search per case")
    parser.add_argument("--in-flight", type=positive, default=3, help="the generator's bound: this times pp in flight")
    parser.add_argument("--restarts", type=int, default=16, help="the generator's seeded extra plans")
    parser.add_argument("--grid", action="store_true",
                        help="every case of ring_schedule.py's grid pp {2,4,8} x m {4,8,16} x mu_rec {4,8,16}")
    parser.add_argument("--show-orders", action="store_true", help="print the per-rank orders of the best schedule")
    parser.add_argument("--non-delay", action="store_true",
                        help="search only schedules where no rank idles while it could start an action (as list "
                             "scheduling makes them)")
    return parser.parse_args(argv)


def case(args, pp: int, m: int, mu_rec: int) -> dict:
    """The generator's makespan, the makespan at the idle target (interleaved 1F1B's (p - 1) / (v m), as
    ring_schedule.py prints it) and the exact search's result for one grid case."""
    from benchmarks.ring_schedule import equal_work_laps, parse_args as grid_args, sampled_specs

    specs = sampled_specs(grid_args(["--seed", str(args.seed)]), m, mu_rec)
    costs = CostModel(forward=1.0, backward=2.0, nograd_forward=1.0)
    makespan, orders = generated(specs, pp, costs, args.in_flight, args.restarts)
    idle = (pp - 1) / (equal_work_laps(specs, costs) * m)  # interleaved 1F1B's, ring_schedule.py's target
    target = sum(Chains(specs, pp, costs).work) / (pp * (1.0 - idle))
    result = solve(specs, pp, costs, makespan, orders, args.time_limit, non_delay=args.non_delay)
    if result.improved and abs(verify(result.orders, specs, costs) - result.best) > EPS:
        raise RuntimeError(f"the simulator's makespan {verify(result.orders, specs, costs)} of the schedule found "
                           f"differs from the search's {result.best}: a bug in the search")
    return dict(pp=pp, m=m, mu=mu_rec, specs=specs, generated=makespan, orders=orders, target=target,
                result=result, bound=args.in_flight * pp, target_idle=idle)


def report(row: dict, show_orders: bool) -> None:
    r = row["result"]
    status = "optimal (proven)" if r.proven else "best found (time limit; not proven)"
    print(f"{row['pp']:3d} {row['m']:3d} {row['mu']:4d} {row['generated']:9.2f} {row['target']:8.2f} {r.bound:8.2f} "
          f"{r.best:8.2f} {100 * (row['generated'] / r.best - 1):+7.3f}% {r.nodes:10d} {r.seconds:8.2f}  {status}")
    if show_orders and r.improved:
        run = simulate(with_p2p(r.orders, row["specs"]), row["specs"], CostModel(forward=1.0, backward=2.0))
        print(f"the best schedule, simulated: makespan {run.makespan:g}, idle {run.idle_fraction:.4f} (target "
              f"{row['target_idle']:.4f}), peak "
              f"micro-batches in flight per rank {run.peak_in_flight}, open {run.peak_open} (the generator's bounds: "
              f"{row['bound']}, {2 * row['bound']}); per-rank orders:")
        for rank, order in enumerate(r.orders):
            print(f"  rank {rank}: " + " ".join(label(a) for a in order))


def report_changes(row: dict) -> None:
    costs = CostModel(forward=1.0, backward=2.0, nograd_forward=1.0)
    base, orders, better = one_change(row["specs"], row["pp"], costs)
    same = all([a for a in mine if costs.of(a, row["specs"])] == [a for a in theirs if costs.of(a, row["specs"])]
               for mine, theirs in zip(orders, row["orders"]))
    print(f"critical-path list schedule: makespan {base:g}, costly actions in {'the same' if same else 'other'} "
          f"per-rank orders as the generator's; {len(better)} changes of one choice shorten it"
          + (":" if better else ""))
    for start, rank, taken, passed, span in better:
        print(f"  at {start:g} on rank {rank}: {taken} before {passed} -> makespan {span:g}")


def main(argv=None) -> int:
    args = parse_args(argv)
    cases = [(pp, m, mu) for pp in (2, 4, 8) for m in (4, 8, 16) for mu in (4, 8, 16)] if args.grid else [
        (args.pp, args.m, args.mu_rec)]
    kind = "non-delay" if args.non_delay else "active"
    print(f"exact ring makespan by branch and bound over {kind} schedules (memory bounds left out), costs forward 1, "
          f"backward 2, no-autograd forward 1; the search starts below the generator's makespan "
          f"({args.in_flight} x pp in flight, {args.restarts} restarts); time limit {args.time_limit:g} s per case")
    print(" pp   m   mu generated   target    lower    exact  gen/exact      nodes  seconds  result")
    for pp, m, mu in cases:
        row = case(args, pp, m, mu)
        if not args.grid:
            print("micro-batches (laps, grad_laps): " + str([(s.laps, s.grad_laps) for s in row["specs"]]))
        report(row, args.show_orders or not args.grid)
        if not args.grid:
            report_changes(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
