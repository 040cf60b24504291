"""Judging the current attempt's heartbeats: each rank's progress, the stragglers, the hung ranks and the run's state.
Pure functions of the lines, the run's limits and the reading time `now`, so that tests give them synthetic lines.

Stragglers. Ranks synchronise every step, so every rank's wall step time is the slowest rank's; what tells a slow
rank is its busy time (its own data, forward and backward, before it waits for the others at the step's reduction).
A rank's busy time here is the median over its last `window` heartbeat lines (each line a mean over
train.heartbeat_every steps; the median leaves out a one-off pause, e.g. a garbage collection); a rank is a
straggler when its busy time is above `factor` x the median of the ranks' busy times in the current attempt.

Hung ranks. A rank is hung when its newest line is not an "end" and is older than the threshold `hung_after`, by
default min(parallel.timeout_s, max(60 s, 5 x the expected gap between heartbeats, 2 x the longest gap between two
step lines of a rank in this attempt)): the expected gap is train.heartbeat_every x the median step time; the longest
gap seen covers the saves and validations that pass between steps; parallel.timeout_s is when the job's own collectives
give up on a silent rank. Before any step line the threshold is parallel.timeout_s (the first step's limit). When a
rank stops, the others wait for it in the step's collectives and fall silent as well: a hang shows as every rank
silent, and the rank that caused it is the one whose process is stopped or gone (cli.py reads that on this node) or
the one the NCCL flight recorder names (<run>/nccl_trace).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

STRAGGLER_FACTOR = 1.5
WINDOW = 5  # heartbeat lines per rank whose median is its busy time in the straggler test
MIN_HUNG_S = 60.0
HUNG_GAPS_EXPECTED = 5  # hung_after >= this many expected gaps between heartbeats
HUNG_GAPS_SEEN = 2  # ... and >= this many times the longest gap seen in the attempt


@dataclass
class Limits:
    """What the run's config.json says about its timing (the defaults of megaloop.config where it is absent)."""
    timeout_s: float = 600.0  # parallel.timeout_s
    startup_timeout_s: float = 1800.0  # parallel.startup_timeout_s (start-up, saves)
    heartbeat_every: int = 10  # train.heartbeat_every
    steps: int | None = None  # train.steps


@dataclass
class RankRow:
    rank: int
    node: str
    pid: int | None
    attempt: str | None
    current: bool  # whether the rank has lines in the current attempt
    event: str  # its newest line's event: start | step | end
    step: int | None  # its newest line's step (steps done)
    age_s: float  # seconds since its newest line
    step_time: float | None = None  # wall seconds per step in its newest step line
    busy_time: float | None = None  # its busy seconds per step: the median over its last `window` step lines
    busy_ratio: float | None = None  # busy_time / the median over the ranks
    flags: list[str] = field(default_factory=list)  # straggler | hung | not in this attempt
    process: str = ""  # alive | stopped | zombie | gone, where the status reader runs on the rank's node


@dataclass
class Verdict:
    stragglers: list[int]
    median_busy_s: float | None
    hung: list[int]
    hung_after_s: float
    hung_rule: str
    straggler_rule: str


def _row(rank: int, lines: list[dict], now: float, window: int, current: bool) -> RankRow:
    last = lines[-1]
    steps = [x for x in lines if x["event"] == "step"]
    recent = steps[-window:]
    busy = [x.get("busy_time", x.get("step_time")) for x in recent]
    busy = [b for b in busy if isinstance(b, (int, float))]
    return RankRow(rank=rank, node=str(last.get("node", "")), pid=last.get("pid"), attempt=last.get("attempt"),
                   current=current, event=last["event"], step=last.get("step"), age_s=max(0.0, now - last["time"]),
                   step_time=steps[-1].get("step_time") if steps else None,
                   busy_time=statistics.median(busy) if busy else None,
                   flags=[] if current else ["not in this attempt"])


def rank_rows(current, now: float, window: int = WINDOW) -> list[RankRow]:
    """One row per rank with a heartbeat file: from its current-attempt lines, else from its newest older line."""
    rows = [_row(rank, lines, now, window, True) for rank, lines in current.lines.items()]
    rows += [_row(rank, [line], now, window, False) for rank, line in current.earlier.items()]
    return sorted(rows, key=lambda r: r.rank)


def find_stragglers(rows: list[RankRow], factor: float) -> tuple[list[int], float | None]:
    """Ranks of the current attempt whose busy time is above factor x the median (sets each row's busy_ratio)."""
    timed = [r for r in rows if r.current and r.busy_time is not None]
    if not timed:
        return [], None
    median = statistics.median(r.busy_time for r in timed)
    slow = []
    for r in timed:
        r.busy_ratio = r.busy_time / median if median > 0 else None
        if median > 0 and r.busy_time > factor * median:
            slow.append(r.rank)
            r.flags.append("straggler")
    return slow, median


def default_hung_after(current, rows: list[RankRow], limits: Limits) -> tuple[float, str]:
    """The hung threshold of the module docstring, and the rule with its figures, for the output."""
    step_times = [r.step_time for r in rows if r.current and r.step_time is not None]
    if not step_times:
        return limits.timeout_s, (f"parallel.timeout_s = {limits.timeout_s:g} s (no step finished yet in this "
                                  "attempt: the first step's limit)")
    expected = limits.heartbeat_every * statistics.median(step_times)
    gaps = [b["time"] - a["time"] for lines in current.lines.values() for a, b in zip(lines, lines[1:])
            if a["event"] == b["event"] == "step"]  # not start -> first step: a first step's compile is no pattern
    longest = max(gaps, default=0.0)
    after = min(limits.timeout_s, max(MIN_HUNG_S, HUNG_GAPS_EXPECTED * expected, HUNG_GAPS_SEEN * longest))
    return after, (f"min(parallel.timeout_s {limits.timeout_s:g} s, max({MIN_HUNG_S:g} s, {HUNG_GAPS_EXPECTED} x "
                   f"{limits.heartbeat_every} step(s) x {statistics.median(step_times):.3g} s median step time, "
                   f"{HUNG_GAPS_SEEN} x {longest:.3g} s longest gap between step heartbeats)) = {after:.3g} s")


def find_hung(rows: list[RankRow], after_s: float) -> list[int]:
    """Ranks of the current attempt, not finished, silent for more than after_s (flags them)."""
    hung = [r.rank for r in rows if r.current and r.event != "end" and r.age_s > after_s]
    for r in rows:
        if r.rank in hung:
            r.flags.append("hung")
    return hung


def judge(current, rows: list[RankRow], limits: Limits, factor: float = STRAGGLER_FACTOR,
          hung_after: float | None = None, window: int = WINDOW) -> Verdict:
    """Stragglers and hung ranks of the current attempt, with the rules that named them."""
    slow, median = find_stragglers(rows, factor)
    if hung_after is None:
        hung_after, rule = default_hung_after(current, rows, limits)
    else:
        rule = f"--hung-after {hung_after:g} s"
    hung = find_hung(rows, hung_after)
    straggler_rule = (f"busy time (median of a rank's last {window} heartbeats) above {factor:g} x the ranks' median"
                      + (f" ({median:.3g} s)" if median is not None else ""))
    return Verdict(slow, median, hung, hung_after, f"no heartbeat for more than {rule}", straggler_rule)


def run_state(markers: dict[str, dict], rows: list[RankRow], verdict: Verdict, limits: Limits,
              quiet_s: float | None) -> tuple[str, str]:
    """(state, why): completed | stopped (markers), else starting | running | finishing | failed-or-stale from the
    current attempt's heartbeats; quiet_s: seconds since anything in the run folder was last written."""
    if "COMPLETED" in markers:
        return "completed", f"COMPLETED marker at step {markers['COMPLETED'].get('step', '?')}"
    if "STOPPED" in markers:
        info = markers["STOPPED"]
        return "stopped", (f"STOPPED marker at step {info.get('step', '?')}"
                           + (f": {info['reason']}" if info.get("reason") else ""))
    current = [r for r in rows if r.current]
    if not current:
        if quiet_s is not None and quiet_s > limits.startup_timeout_s:
            return "failed-or-stale", (f"no heartbeat from any attempt and nothing written for {quiet_s:.0f} s "
                                       f"(more than parallel.startup_timeout_s {limits.startup_timeout_s:g} s)")
        return "starting", "no rank has written a heartbeat yet (starting, or train.heartbeat_every=0)"
    if all(r.event == "end" for r in current):
        since = min(r.age_s for r in current)
        if since > limits.startup_timeout_s:
            return "failed-or-stale", (f"every rank left the training loop {since:.0f} s ago and no COMPLETED or "
                                       "STOPPED marker followed: the final save or validation failed or the job was "
                                       "killed (see its log)")
        return "finishing", f"every rank left the training loop {since:.0f} s ago (final save and validation)"
    if verdict.hung:
        silent = "every rank" if len(verdict.hung) == len(current) else "rank(s) " + ", ".join(map(str, verdict.hung))
        return "failed-or-stale", (f"no heartbeat from {silent} for more than {verdict.hung_after_s:.3g} s "
                                   "(the job failed, or hangs)")
    step = max((r.step for r in current if r.step is not None), default=0)
    return "running", f"step {step}" + (f" of {limits.steps}" if limits.steps else "")
