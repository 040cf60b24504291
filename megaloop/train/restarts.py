"""The "restart" record: when an attempt of a run resumes after failures, what each failure cost
(megaloop.train.metrics.RESTART_FIELDS), written to metrics.jsonl and listed in the run's summary.

Sources, in the run's out_dir, read by rank 0 before this attempt writes its first heartbeat line:
  failures.jsonl: one "failure" line per failed attempt, written by the launcher (slurm.agent, or the Slurm batch
    script when the whole training step died; format in slurm/failures.py) with the cause, the rank blamed and its
    node. The failures after the file's last "restart" line are this attempt's to settle: it appends its restart
    records there too, so that each failure is settled once, by the first attempt that gets to train after it.
  heartbeat/rank_<R>.jsonl (megaloop.train.heartbeat): what the failed attempt had done, and when.
When failures.jsonl has nothing to settle (a launcher that does not write it) but the previous attempt's heartbeat
lines stop without an "end" on some rank, that attempt failed unrecorded: one record, cause "an unrecorded failure",
with the rank whose heartbeat stopped first.

The figures, for the failures F_1..F_n settled here (oldest first; F_i failed at t_i), s being the step this attempt
resumes from. The attempt that failed as F_i is told by its heartbeat lines written after the previous failure (or
after the last settled restart) and up to t_i, from each rank's newest "start" line on, when that rank's lines there
hold no "end" (a rank whose attempt ended cleanly, e.g. stopped and saved, lost nothing).
  attempt: this restart's number in the run (1 for the first restart after a failure);
  steps_lost: the newest step any rank's heartbeat reported in that attempt, minus s; 0 when it never got past s.
    Heartbeats come every train.heartbeat_every steps, so up to that many minus one more steps may have been lost;
  time_lost_s: from the moment that attempt had completed step s (its first heartbeat line at or past s, moved back
    by the line's step time for each step past s; t_i when it never got there) to t_{i+1}, or, for F_n, to now (this
    attempt is ready to train): the work redone plus the time to fail over and start again. Consecutive failures
    share no second, so the records' times add up to the time the run stood still;
  cause, rank, node: the failure line's (rank -1 there: the rank whose heartbeat stopped first, cause kept).
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

from megaloop.train.heartbeat import read_heartbeats
from megaloop.train.metrics import read_json_lines

FAILURES = "failures.jsonl"  # slurm.failures.FILE (megaloop does not import the slurm package)
LATE_S = 2.0  # a failed attempt's last lines may follow the launcher's note of the failure by this much
IMPORTED_AT = time.time()  # before this process joined its attempt: every line of an earlier attempt is older
UNRECORDED = "an unrecorded failure (the previous attempt's heartbeats stop without an end)"


def _read_lines(path: Path) -> list[dict]:
    """The file's timed lines (a torn or foreign line is left out)."""
    return [r for r in read_json_lines(path) if isinstance(r.get("time"), (int, float))]


def _ends_torn(f) -> bool:
    """Whether the file does not end with a line break (a line torn by a crash): the next line starts on its own."""
    size = f.seek(0, os.SEEK_END)
    if not size:
        return False
    f.seek(size - 1)
    return f.read(1) != b"\n"


def pending_failures(lines: list[dict]) -> tuple[list[dict], float, int]:
    """The "failure" lines after the last "restart" line, that line's time (-inf: none) and the restarts so far."""
    settled = [i for i, r in enumerate(lines) if r.get("kind") == "restart"]
    after = settled[-1] + 1 if settled else 0
    since = lines[settled[-1]]["time"] if settled else -math.inf
    return [r for r in lines[after:] if r.get("kind") == "failure"], since, len(settled)


def attempt_lines(heartbeats: dict[int, list[dict]], lo: float, hi: float) -> dict[int, list[dict]]:
    """rank -> its lines of the attempt that ran between lo and hi (exclusive, inclusive): from its newest start line
    there, and none for a rank whose lines there end its attempt cleanly ("end")."""
    found = {}
    for rank, lines in heartbeats.items():
        window = [x for x in lines if isinstance(x.get("time"), (int, float)) and lo < x["time"] <= hi]
        starts = [i for i, x in enumerate(window) if x.get("event") == "start"]
        window = window[starts[-1]:] if starts else window
        if window and not any(x.get("event") == "end" for x in window):
            found[rank] = window
    return found


def _step_done_at(lines: list[dict], step: int) -> float | None:
    """When this rank had completed `step` (see the module docstring); None when its lines never got there."""
    previous = -math.inf
    for x in lines:
        if isinstance(x.get("step"), int) and x["step"] >= step:
            back = (x["step"] - step) * x["step_time"] if isinstance(x.get("step_time"), (int, float)) else 0.0
            return max(x["time"] - back, previous)
        previous = x["time"]
    return None


def failure_cost(lines: dict[int, list[dict]], start: int, failed_at: float, until: float) -> tuple[int, float]:
    """(steps lost, seconds lost) of one failed attempt's heartbeat lines (see the module docstring)."""
    steps = [x["step"] for xs in lines.values() for x in xs if isinstance(x.get("step"), int)]
    done_at = [t for t in (_step_done_at(xs, start) for xs in lines.values()) if t is not None]
    since = min(done_at) if done_at else failed_at
    return max(0, max(steps, default=start) - start), max(0.0, until - since)


def stalled(lines: dict[int, list[dict]]) -> tuple[int, str]:
    """The rank whose newest line is the oldest, and its node ((-1, "") without lines)."""
    if not lines:
        return -1, ""
    rank = min(lines, key=lambda r: (lines[r][-1]["time"], r))
    return rank, str(lines[rank][-1].get("node", ""))


def restart_records(out_dir: str | Path, start: int, now: float | None = None,
                    imported_at: float = IMPORTED_AT) -> list[dict]:
    """The restart records this attempt owes (see the module docstring), oldest first; [] after no failure."""
    out = Path(out_dir)
    now = time.time() if now is None else now
    failures, lo, done = pending_failures(_read_lines(out / FAILURES))
    heartbeats = read_heartbeats(out)
    if not failures:
        lines = attempt_lines(heartbeats, lo, imported_at)
        if not lines:
            return []
        newest = max(x["time"] for xs in lines.values() for x in xs)
        rank, node = stalled(lines)
        failures = [{"time": newest, "cause": UNRECORDED, "rank": rank, "node": node}]
    records = []
    for i, failure in enumerate(failures):
        hi = failure["time"] + LATE_S
        lines = attempt_lines(heartbeats, lo, hi)
        until = failures[i + 1]["time"] if i + 1 < len(failures) else now
        steps_lost, time_lost = failure_cost(lines, start, failure["time"], until)
        rank, node = int(failure.get("rank", -1)), str(failure.get("node", ""))
        if rank < 0:
            rank, node = stalled(lines)
        records.append({"kind": "restart", "step": start, "attempt": done + i + 1,
                        "cause": str(failure.get("cause") or UNRECORDED), "rank": rank, "node": node,
                        "steps_lost": steps_lost, "time_lost_s": round(time_lost, 3)})
        lo = hi
    return records


def record_restarts(out_dir: str | Path, start: int, write, now: float | None = None) -> list[dict]:
    """Write this attempt's restart records (`write`: the metrics writer's) and settle them in failures.jsonl; the
    run's restart records so far, for the summary. Call on rank 0 only, before the attempt's first heartbeat."""
    path = Path(out_dir) / FAILURES
    now = time.time() if now is None else now
    new = restart_records(out_dir, start, now)
    for record in new:
        write(record)
        print(f"megaloop: restart {record['attempt']} after {record['cause']} (rank {record['rank']} on "
              f"{record['node'] or '?'}): resuming at step {start}, {record['steps_lost']} step(s) and "
              f"{record['time_lost_s']:.1f} s lost", flush=True)
    if new:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = "".join(json.dumps({**r, "time": now}) + "\n" for r in new)
        with open(path, "a+b") as f:
            f.write((("\n" if _ends_torn(f) else "") + text).encode())
    return [{k: v for k, v in r.items() if k != "time"} for r in _read_lines(path) if r.get("kind") == "restart"]
