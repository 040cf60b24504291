"""`python -m megaloop status RUN_DIR [--json]`: a run's state, its ranks' progress, stragglers, hung ranks,
restarts and rollbacks (the rules in megaloop/status/assess.py). Exit code 0 for a run folder whatever its state,
2 for a folder that holds no run."""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from data_prep.paths import LocalPath
from megaloop.status.assess import STRAGGLER_FACTOR, WINDOW, judge, rank_rows, run_state
from megaloop.status.attempt import current_attempt
from megaloop.status.folder import NotARun, limits_of, process_state, read_folder, slurm_job

HELP = ("show a run's state (running, completed, stopped, failed or stale), each rank's progress from its heartbeat, "
        "the stragglers and hung ranks of the current attempt, and its restarts and rollbacks, e.g. "
        "`python -m megaloop status runs/quickstart`")

RULES = ("States: completed or stopped (the COMPLETED/STOPPED marker), else from the current attempt's heartbeats: "
         "starting (none yet, or the Slurm job waits in the queue), running, finishing (every rank left the loop: "
         "final save and validation), failed-or-stale (a rank silent past the hung threshold, the loop left without "
         "a marker, or the Slurm job left the queue without one). "
         "Exit code 0 for a run folder whatever its state, 2 for a folder that holds no run")


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a whole number >= 1")
    return int(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=LocalPath(as_path=True), metavar="RUN_DIR",
                   help="the run's folder (its train.out_dir), local or on the cluster's shared file system")
    p.add_argument("--straggler-factor", type=_positive, default=STRAGGLER_FACTOR, metavar="F",
                   help="a rank is a straggler when its busy time per step (its own work before it waits for the "
                        f"others) is above F x the median over the ranks (default {STRAGGLER_FACTOR})")
    p.add_argument("--hung-after", type=_positive, default=None, metavar="SECONDS",
                   help="a rank is hung when it wrote no heartbeat for longer than this (default: min("
                        "parallel.timeout_s, max(60 s, 5 x train.heartbeat_every x the median step time, 2 x the "
                        "longest gap between step heartbeats seen)); the output states the figure")
    p.add_argument("--window", type=_count, default=WINDOW, metavar="N",
                   help=f"heartbeat lines per rank whose median is its busy time in the straggler test "
                        f"(default {WINDOW})")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")


def build_status(run_dir: Path, factor: float = STRAGGLER_FACTOR, hung_after: float | None = None,
                 window: int = WINDOW, now: float | None = None) -> dict:
    """The status of the run in run_dir as one JSON-ready dict (what --json prints); NotARun when it is none."""
    now = time.time() if now is None else now
    run = read_folder(run_dir, now)
    limits = limits_of(run.config)
    current = current_attempt(run.heartbeats)
    rows = rank_rows(current, now, window)
    for row in rows:
        row.process = process_state(row.node, row.pid)
    verdict = judge(current, rows, limits, factor, hung_after, window)
    state, why = run_state(run.markers, rows, verdict, limits, run.quiet_s)
    slurm = slurm_job(Path(run_dir), current.attempt)
    if slurm and state not in ("completed", "stopped") and not (current.attempt or "").startswith("local."):
        state, why = slurm_verdict(slurm, state, why)
    return {"run_dir": str(run_dir), "state": state, "why": why, "attempt": current.attempt,
            "attempt_started": current.started_at, "now": now, "limits": asdict(limits),
            "ranks": [asdict(r) for r in rows], "stragglers": verdict.stragglers,
            "straggler_factor": factor, "straggler_rule": verdict.straggler_rule,
            "median_busy_s": verdict.median_busy_s,
            "hung": verdict.hung, "hung_after_s": verdict.hung_after_s, "hung_rule": verdict.hung_rule,
            "restarts": run.restarts, "rollbacks": run.rollbacks, "markers": run.markers,
            "summary": _summary_figures(run.summary), "slurm": slurm, "nccl_dumps": run.nccl_dumps}


def slurm_verdict(slurm: dict, state: str, why: str) -> tuple[str, str]:
    """The state with the queue's word: a job Slurm no longer lists that left no marker has failed (the trainer
    writes COMPLETED or STOPPED before its processes exit); a job waiting in the queue is not stale."""
    queue = slurm["queue"]
    if queue == "not in the queue":
        return "failed-or-stale", (f"Slurm job {slurm['job']} is no longer in the queue and left no COMPLETED or "
                                   f"STOPPED marker; see {slurm['log'] or 'its log'}")
    if queue and "RUNNING" not in queue and state in ("starting", "failed-or-stale"):
        return "starting", f"Slurm job {slurm['job']} is {queue}"
    return state, why


def _summary_figures(summary: dict | None) -> dict | None:
    keys = ("steps_done", "stop_reason", "tokens", "train_time_s", "tokens_per_s", "restarts", "rollbacks", "epoch")
    return None if summary is None else {k: summary[k] for k in keys if k in summary}


def run_status(args) -> int:
    try:
        status = build_status(args.run_dir, args.straggler_factor, args.hung_after, args.window)
    except NotARun as err:
        print(f"megaloop status: {err}", file=sys.stderr)
        return 2
    print(json.dumps(status, indent=2) if args.json else render(status))
    return 0


def _num(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def _rank_table(ranks: list[dict]) -> list[str]:
    head = f"  {'rank':>4}  {'node':<16} {'pid':>7}  {'step':>6}  {'age s':>7}  {'step s':>7}  {'busy s':>7}  " \
           f"{'busy/med':>8}  process  notes"
    lines = [head]
    for r in ranks:
        notes = ", ".join(r["flags"] + (["left the loop"] if r["event"] == "end" else []))
        lines.append(f"  {r['rank']:>4}  {r['node'][:16]:<16} {_num(r['pid']):>7}  {_num(r['step']):>6}  "
                     f"{r['age_s']:>7.1f}  {_num(r['step_time']):>7}  {_num(r['busy_time']):>7}  "
                     f"{_num(r['busy_ratio']):>8}  {r['process'] or '-':<7}  {notes}")
    return lines


def _restart_lines(status: dict) -> list[str]:
    lines = [f"restarts: {len(status['restarts']) or 'none'}"]
    for r in status["restarts"]:
        where = f"rank {r.get('rank')} on {r.get('node') or '?'}" if r.get("rank", -1) != -1 else "rank unknown"
        lines.append(f"  attempt {r.get('attempt')}: resumed at step {r.get('step')} after {r.get('cause')} "
                     f"({where}); lost {r.get('steps_lost')} step(s), {_num(r.get('time_lost_s'))} s")
    lines.append(f"rollbacks: {len(status['rollbacks']) or 'none'}")
    for r in status["rollbacks"]:
        lines.append(f"  spike at step {r.get('step')}: restored step {r.get('restored_step')}, skipped batches "
                     f"{r.get('skipped_batches')} (samples {r.get('skipped_samples')}); rollback {r.get('rollbacks')}")
    return lines


def render(status: dict) -> str:
    """The text report of build_status's dict."""
    lines = [f"run {status['run_dir']}: {status['state']} ({status['why']})"]
    if status["attempt"]:
        lines.append(f"attempt {status['attempt']}, {sum(r['current'] for r in status['ranks'])} rank(s) in it, "
                     f"heartbeat every {status['limits']['heartbeat_every']} step(s)")
    slurm = status.get("slurm")
    if slurm:
        lines.append(f"slurm job {slurm['job']}: {slurm['queue'] or 'queue state unknown'}"
                     + (f"; log {slurm['log']}" if slurm["log"] else ""))
        if slurm["last_line"]:
            lines.append(f"  {slurm['last_line']}")
    if status["ranks"]:
        lines += _rank_table(status["ranks"])
    named = ", ".join(f"rank {r['rank']} ({r['node']}, {_num(r['busy_ratio'])} x)" for r in status["ranks"]
                      if r["rank"] in status["stragglers"])
    lines.append(f"stragglers (factor {status['straggler_factor']:g}: {status['straggler_rule']}): {named or 'none'}")
    lines.append(f"hung ({status['hung_rule']}): "
                 + (", ".join(f"rank {r}" for r in status["hung"]) if status["hung"] else "none"))
    if status["hung"] and len(status["hung"]) > 1:
        lines.append("  several ranks silent: they wait for one another in a collective; the cause is a rank whose "
                     "process is stopped or gone, or the one named in the NCCL flight recorder's dumps "
                     f"({Path(status['run_dir']) / 'nccl_trace'})")
    if status["nccl_dumps"]:
        lines.append(f"NCCL flight recorder: {len(status['nccl_dumps'])} dump(s) in "
                     f"{Path(status['run_dir']) / 'nccl_trace'} ({', '.join(status['nccl_dumps'][:8])})")
    lines += _restart_lines(status)
    if status["summary"]:
        lines.append("summary: " + ", ".join(f"{k} {len(v) if isinstance(v, list) else _num(v)}"
                                             for k, v in status["summary"].items() if v is not None))
    return "\n".join(lines)
