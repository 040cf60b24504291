"""The run's failure log, <out_dir>/failures.jsonl, and the recovery policy read from it: which rank's failure ended
an attempt of the training processes, and when to stop restarting them.

One JSON object per line, appended, never rewritten (a line torn by a crash is skipped when read):
  {"kind": "failure", "time", "job", "restart", "round", "source", "rank", "node", "cause", "count", "max_failures"}
      an attempt failed. source "agent": slurm.agent saw a worker die, hang or raise (one line per failed round of
      the worker group, written by the first agent that saw it); "step": the whole training step ended without a
      verdict from the agent (a lost node, a killed agent), written by the batch script. job, restart: Slurm's job id
      and restart count; round: torchrun's restart count in that job; rank, node: the rank blamed (-1, "" when none
      could be named); count: the failures within the window, this one included.
  {"kind": "gave_up", "time", "job", "reason"}
      the failure budget is spent and nothing restarts the run: the job ends FAILED; `reason` is the one line that
      says so.
  {"kind": "restart", ...}
      written by the trainer (megaloop.train.restarts) when an attempt resumes after failures: it settles the failures
      above it (the same fields as metrics.jsonl's "restart" record).

The budget: `--max-failures N` failures within WINDOW_S (one hour), counted over in-job restarts and requeues alike
(every failure of the run lands in this one file, whichever job or node saw it). The Nth one ends the job FAILED; the
run's checkpoints are left as they are, so submitting the same command again continues from the newest one.

Which rank is blamed when several failed at once (a dead rank makes its peers' collectives fail too): a stopped
process (a hang), then death by a signal other than SIGTERM or SIGABRT, then an error of its own (not a communication
error), then a bare non-zero exit, then a rank still running while the others' collectives timed out (a hang), then
SIGABRT (the NCCL watchdog aborts a rank whose collective timed out), then communication errors, then SIGTERM (the
launcher's). The lowest rank wins a tie. Nothing here imports megaloop (the heartbeat files are read as documented
in megaloop/train/heartbeat.py)."""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

FILE = "failures.jsonl"
WINDOW_S = 3600.0
DEFAULT_MAX_FAILURES = 3
COMMUNICATION = re.compile(r"connection (closed|reset) by peer|timed out|timeout|broken pipe|DistBackendError|"
                           r"DistNetworkError|DistStoreError|NCCL|gloo", re.I)
TIMEOUT = re.compile(r"timed out|timeout", re.I)
NO_MESSAGE = "To enable traceback see"  # torchrun's placeholder when a worker left no error file


@dataclass(frozen=True)
class WorkerOutcome:
    """What one worker looked like when its group failed: exitcode None while it still runs (negative: the signal
    that ended it), stopped when it was stopped (SIGSTOP, SIGTSTP), message its error's first line ("" for none)."""

    rank: int
    node: str
    exitcode: int | None
    stopped: bool = False
    message: str = ""


def _severity(o: WorkerOutcome, peers_timed_out: bool) -> int:
    if o.stopped:
        return 0
    if o.exitcode is None:
        return 4 if peers_timed_out else 9
    if o.exitcode < 0:
        return {signal.SIGTERM: 8, signal.SIGABRT: 6}.get(-o.exitcode, 1)
    if o.message:
        return 7 if COMMUNICATION.search(o.message) else 2
    return 3


def blame(outcomes: list[WorkerOutcome]) -> WorkerOutcome | None:
    """The worker whose failure most likely caused the others' (the order in the module docstring); None for none."""
    timed_out = any(o.exitcode is not None and TIMEOUT.search(o.message) for o in outcomes)
    ranked = sorted(outcomes, key=lambda o: (_severity(o, timed_out), o.rank))
    return ranked[0] if ranked and _severity(ranked[0], timed_out) < 9 else None


def describe(o: WorkerOutcome) -> str:
    """The cause as a noun phrase ("death by SIGKILL"), for the failure line and the trainer's restart record."""
    if o.stopped:
        return "a hang (the process was stopped, e.g. by SIGSTOP, and was ended with SIGKILL)"
    if o.exitcode is None:
        return "a hang (no progress while the other ranks' collectives timed out)"
    if o.exitcode < 0:
        try:
            name = signal.Signals(-o.exitcode).name
        except ValueError:
            name = f"signal {-o.exitcode}"
        return f"death by {name}" + (" (kill -9, or the kernel's out-of-memory killer)" if name == "SIGKILL" else "")
    if o.message:
        kind = "a communication error" if COMMUNICATION.search(o.message) else "an error"
        return f"{kind} ({o.message[:200]})"
    return f"exit code {o.exitcode}" + (" (a refused config or input: see the job's output)" if o.exitcode == 2
                                        else " (no error message: see the job's output)")


def first_line(message) -> str:
    """A worker's error message (torchrun's error file: a string or {"message": ...}) as one line; "" for none."""
    if isinstance(message, dict):
        message = message.get("message", "")
    text = str(message or "").strip()
    if not text or text.startswith(NO_MESSAGE):
        return ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines[0].startswith("Traceback") else lines[0]


# ---- the file ----------------------------------------------------------------------------------------------------
def ends_torn(f) -> bool:
    """Whether a file open for binary reading does not end with a line break (a line torn by a crash)."""
    size = f.seek(0, os.SEEK_END)
    if not size:
        return False
    f.seek(size - 1)
    return f.read(1) != b"\n"


def append(path: str | Path, record: dict) -> dict:
    """Append one line (created with its folder when missing); one write, under an exclusive lock where the file
    system has locks, so that agents of several nodes never interleave, and after a line break when a crash left the
    last line torn (the torn line is then skipped alone, not merged with this one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record) + "\n"
    with open(path, "a+b") as f:
        try:
            import fcntl

            fcntl.flock(f, fcntl.LOCK_EX)
        except (ImportError, OSError):
            pass
        f.write((("\n" if ends_torn(f) else "") + line).encode())
    return record


def read(path: str | Path) -> list[dict]:
    """The file's lines, oldest first (a torn or foreign line is left out); [] when there is no file."""
    try:
        text = Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return []
    found = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("time"), (int, float)):
            found.append(record)
    return found


def failures_within(lines: list[dict], now: float, window_s: float = WINDOW_S) -> int:
    return sum(1 for r in lines if r.get("kind") == "failure" and now - window_s < r["time"] <= now + 1)


def job_ids(environ=None) -> tuple[str, int]:
    env = os.environ if environ is None else environ
    try:
        restart = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
    except ValueError:
        restart = 0
    return env.get("SLURM_JOB_ID", "local"), restart


def give_up_reason(count: int, max_failures: int, window_s: float, last: dict) -> str:
    where = f"rank {last['rank']} on {last['node'] or '?'}" if last.get("rank", -1) >= 0 else "no rank named"
    failures = f"{count} failure{'s' if count != 1 else ''}"
    return (f"{failures} within {window_s / 3600:g} h reached --max-failures {max_failures}, the last: "
            f"{last['cause']} ({where}); not restarting: the run's checkpoints are kept, and submitting the same "
            "command again continues from the newest committed one once the cause is fixed")


@dataclass
class FailureLog:
    """The budget over one run's failures.jsonl (see the module docstring)."""

    path: Path
    max_failures: int = DEFAULT_MAX_FAILURES
    window_s: float = WINDOW_S

    def record(self, blamed: WorkerOutcome | None, cause: str, source: str, round_: int = 0,
               environ=None, now: float | None = None) -> str | None:
        """Append the failure; the one-line reason when it spends the budget (a "gave_up" line is appended too),
        else None: restart."""
        now = time.time() if now is None else now
        job, restart = job_ids(environ)
        count = failures_within(read(self.path), now, self.window_s) + 1
        line = append(self.path, {"kind": "failure", "time": now, "job": job, "restart": restart, "round": round_,
                                  "source": source, "rank": blamed.rank if blamed else -1,
                                  "node": blamed.node if blamed else "", "cause": cause, "count": count,
                                  "max_failures": self.max_failures})
        if count < self.max_failures:
            return None
        return self.give_up(give_up_reason(count, self.max_failures, self.window_s, line), now, environ)

    def give_up(self, reason: str, now: float | None = None, environ=None) -> str:
        append(self.path, {"kind": "gave_up", "time": time.time() if now is None else now,
                           "job": job_ids(environ)[0], "reason": reason})
        return reason

    def verdict_since(self, since: float, environ=None) -> str | None:
        """The reason of a "gave_up" line this job wrote at or after `since` (None: none)."""
        job = job_ids(environ)[0]
        found = [r for r in read(self.path) if r.get("kind") == "gave_up" and r["time"] >= since
                 and r.get("job") == job]
        return found[-1].get("reason", "") if found else None


# ---- the batch script's helper -------------------------------------------------------------------------------------
def stalled_rank(out_dir: Path) -> WorkerOutcome | None:
    """From the heartbeat files (<out_dir>/heartbeat/rank_<R>.jsonl): the rank whose newest line is the oldest, among
    the ranks whose newest line is not an "end" (None: no such rank)."""
    newest = []
    for path in sorted((out_dir / "heartbeat").glob("rank_*.jsonl")):
        last = read(path)[-1:] or [None]
        if last[0] and last[0].get("event") != "end" and isinstance(last[0].get("rank"), int):
            newest.append(last[0])
    if not newest:
        return None
    line = min(newest, key=lambda x: x["time"])
    return WorkerOutcome(line["rank"], str(line.get("node", "")), None)


def step_ended(path: Path, max_failures: int, since: float, exit_code: int) -> tuple[str, str]:
    """The batch script's decision after a training step that left no COMPLETED or STOPPED marker: ("fail", reason)
    when the agent gave up (its reason) or this failure spends the budget, else ("requeue", what happened)."""
    log = FailureLog(path, max_failures)
    reason = log.verdict_since(since)
    if reason is not None:
        return "fail", reason
    if exit_code == 0:
        return "fail", ("the training processes exited 0 without a COMPLETED or STOPPED marker: nothing to restart; "
                        "see the job's output")
    blamed = stalled_rank(path.parent)
    cause = (f"the end of the whole training step (exit code {exit_code}) without a verdict from slurm.agent: a lost "
             "node, a killed agent or a failed rendezvous")
    reason = log.record(blamed, cause, "step")
    if reason is not None:
        return "fail", reason
    count = failures_within(read(path), time.time(), log.window_s)
    where = f"; the rank that stopped first: {blamed.rank} on {blamed.node}" if blamed else ""
    return "requeue", f"failure {count} within 1 h (--max-failures {max_failures}): {cause}{where}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m slurm.failures", description="The batch script's decision after a "
                                 "training step that left no marker: prints `fail REASON` or `requeue WHAT`.")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("step-ended")
    p.add_argument("file", help="the run's failures.jsonl")
    p.add_argument("--max-failures", type=int, required=True)
    p.add_argument("--since", type=float, required=True, help="unix time the training step started")
    p.add_argument("--exit-code", type=int, required=True)
    args = ap.parse_args(argv)
    action, text = step_ended(Path(args.file), args.max_failures, args.since, args.exit_code)
    print(f"{action} {text}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
