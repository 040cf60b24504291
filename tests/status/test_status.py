"""`megaloop status` on synthetic run folders: heartbeat lines written with known times and busy times, so that each
straggler, hung rank and state is checked against figures worked out by hand from the rules in
megaloop/status/assess.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megaloop.__main__ import main
from megaloop.status.assess import Limits, default_hung_after, rank_rows
from megaloop.status.attempt import current_attempt
from megaloop.status.cli import build_status, render
from megaloop.status.folder import process_state
from megaloop.train.heartbeat import Heartbeat, read_heartbeats

NOW = 1_000_000.0  # the reading time of every synthetic run: lines are placed relative to it


@pytest.fixture(autouse=True)
def no_real_queue(monkeypatch, tmp_path):
    """squeue is a fake on PATH that knows job 12 only (RUNNING) and job 13 (PENDING): the synthetic Slurm job ids
    must not meet the local cluster's real jobs."""
    fake = tmp_path / "fakebin"
    fake.mkdir()
    (fake / "squeue").write_text('#!/bin/sh\ncase "$3" in 12) echo RUNNING; echo RUNNING ;; 13) echo PENDING ;; '
                                 '*) echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1 ;; esac\n')
    (fake / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")


def write_rank(run: Path, rank: int, attempt: str, start: float, busy: list[float], step_time: float = 0.5,
               first_step: int = 0, end: bool = False, node: str = "node-a") -> None:
    """A rank's start line at `start`, then one step line per busy time, `step_time` apart (heartbeat_every 1)."""
    base = {"rank": rank, "node": node, "pid": 4_000_000 + rank, "attempt": attempt}
    lines = [{"event": "start", **base, "step": first_step, "time": start}]
    for i, b in enumerate(busy, 1):
        lines.append({"event": "step", **base, "step": first_step + i, "step_time": step_time, "busy_time": b,
                      "time": start + i * step_time})
    if end:
        lines.append({"event": "end", **base, "step": first_step + len(busy), "time": start + len(busy) * step_time})
    path = run / "heartbeat" / f"rank_{rank}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.writelines(json.dumps(x) + "\n" for x in lines)


def make_run(run: Path, timeout_s: float = 600.0, heartbeat_every: int = 1, steps: int = 100) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.json").write_text(json.dumps({"parallel": {"timeout_s": timeout_s, "startup_timeout_s": 1800.0},
                                                 "train": {"heartbeat_every": heartbeat_every, "steps": steps}}))
    return run


def test_the_slow_rank_is_the_only_straggler_named(tmp_path):
    run = make_run(tmp_path / "run")
    busy = {0: [0.10] * 6, 1: [0.11] * 6, 2: [0.40] * 6, 3: [0.09] * 6}
    busy[0][0] = 5.0  # a pause older than the window of 5 lines: not counted
    busy[3][-1] = 0.9  # one slow line inside the window: the median of the 5 leaves it out
    for rank, b in busy.items():
        write_rank(run, rank, "local.0.0", NOW - 4.0, b)
    status = build_status(run, now=NOW)
    median = (0.10 + 0.11) / 2  # busy times 0.10, 0.11, 0.40, 0.09 -> the median of 4 is the mean of the middle two
    assert status["stragglers"] == [2] and status["hung"] == [] and status["state"] == "running"
    assert status["median_busy_s"] == pytest.approx(median, rel=1e-12)
    ratio = {r["rank"]: r["busy_ratio"] for r in status["ranks"]}
    assert ratio[2] == pytest.approx(0.40 / median, rel=1e-12) and ratio[3] == pytest.approx(0.09 / median, rel=1e-12)
    text = render(status)
    assert "factor 1.5" in text and "rank 2 (node-a, 3.81 x)" in text, text
    assert build_status(run, factor=4.0, now=NOW)["stragglers"] == []  # 0.40 / 0.105 = 3.81 < 4


def test_a_silent_rank_is_hung_past_the_default_threshold(tmp_path):
    run = make_run(tmp_path / "run", heartbeat_every=10)
    for rank in range(4):  # one start for all; lines 5 s apart; rank 1's newest 101 s ago, the others' 1 s ago
        write_rank(run, rank, "12.0.0", NOW - 116.0, [0.4] * (3 if rank == 1 else 23), step_time=5.0)
    status = build_status(run, now=NOW)
    # hung_after = min(600, max(60, 5 x 10 steps x 5.0 s, 2 x 5.0 s gap)) = 250 s: nobody is hung yet
    assert status["hung_after_s"] == pytest.approx(250.0) and status["hung"] == [] and status["state"] == "running"
    status = build_status(run, hung_after=50.0, now=NOW)
    assert status["hung"] == [1] and status["state"] == "failed-or-stale" and "rank(s) 1" in status["why"]
    assert "--hung-after 50 s" in render(status)
    make_run(run, timeout_s=30.0, heartbeat_every=10)  # parallel.timeout_s caps the default
    status = build_status(run, now=NOW)
    assert status["hung_after_s"] == pytest.approx(30.0) and status["hung"] == [1]
    assert "parallel.timeout_s 30 s" in status["hung_rule"]
    status = build_status(run, now=NOW + 60.0)  # what a hang looks like: the others wait for rank 1, silent too
    assert status["hung"] == [0, 1, 2, 3] and "no heartbeat from every rank for more than 30 s" in status["why"]
    assert "several ranks silent" in render(status)


def test_the_threshold_grows_with_the_longest_gap_seen(tmp_path):
    """A gap of 40 s between two lines (a save, a validation) lifts the floor to 2 x 40 = 80 s."""
    run = make_run(tmp_path / "run")
    write_rank(run, 0, "local.0.0", NOW - 41.0, [0.1], step_time=0.5)
    with open(run / "heartbeat" / "rank_0.jsonl", "a") as f:
        f.write(json.dumps({"event": "step", "rank": 0, "node": "n", "pid": 1, "attempt": "local.0.0", "step": 2,
                            "step_time": 0.5, "busy_time": 0.1, "time": NOW - 0.5}) + "\n")
    current = current_attempt(read_heartbeats(run))
    after, rule = default_hung_after(current, rank_rows(current, NOW), Limits(heartbeat_every=1))
    assert after == pytest.approx(2 * 40.0) and "2 x 40 s longest gap" in rule


def test_a_finished_run_is_completed_and_nothing_is_hung(tmp_path, monkeypatch):
    """Written by the trainer's own Heartbeat class, read an hour later: ended ranks are never hung."""
    run = make_run(tmp_path / "run", steps=3)
    monkeypatch.setenv("SLURM_JOB_ID", "991")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    clock = iter(range(100, 200)).__next__
    beats = [Heartbeat(run, rank, every_steps=1, clock=lambda: float(clock())) for rank in range(2)]
    for hb in beats:  # in the order a job writes them: every start before any step line
        hb.start(0)
    for step in range(1, 4):
        for hb in beats:
            hb.ready(0.2 if hb.rank == 0 else 0.1)
            hb.beat(step, 0.25, last=step == 3)
    for hb in beats:
        hb.close(3)
    (run / "COMPLETED").write_text(json.dumps({"step": 3}) + "\n")
    (run / "summary.json").write_text(json.dumps({"steps_done": 3, "stop_reason": None}))
    status = build_status(run, now=3600.0)
    assert status["state"] == "completed" and status["why"] == "COMPLETED marker at step 3"
    assert status["hung"] == [] and status["attempt"] == "991.0.0"
    assert [r["step"] for r in status["ranks"]] == [3, 3] and [r["event"] for r in status["ranks"]] == ["end"] * 2
    assert status["ranks"][0]["busy_time"] == pytest.approx(0.2) and status["stragglers"] == []  # 0.2 < 1.5 x 0.15
    assert status["summary"] == {"steps_done": 3, "stop_reason": None}
    assert status["slurm"] == {"job": "991", "log": "", "last_line": "", "queue": "not in the queue"}


def test_restarts_and_rollbacks_from_metrics_are_shown(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    write_rank(run, 0, "12.1.0", NOW - 2.0, [0.1, 0.1], first_step=20)
    restart = {"kind": "restart", "step": 20, "attempt": 1, "cause": "rank exited with signal SIGKILL", "rank": 3,
               "node": "node-d", "steps_lost": 7, "time_lost_s": 42.5}
    rollback = {"kind": "rollback", "step": 30, "restored_step": 25, "skipped_batches": [15, 30],
                "skipped_samples": [[120, 240]], "rollbacks": 1}
    with open(run / "metrics.jsonl", "w") as f:
        for record in ({"kind": "train", "step": 19, "loss": 3.0}, restart, rollback):
            f.write(json.dumps(record) + "\n")
        f.write('{"kind": "train", "st')  # a torn last line, as while the job writes
    assert main(["status", str(run), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["restarts"] == [restart] and status["rollbacks"] == [rollback]
    assert main(["status", str(run)]) == 0
    text = capsys.readouterr().out
    assert ("attempt 1: resumed at step 20 after rank exited with signal SIGKILL (rank 3 on node-d); lost 7 step(s), "
            "42.5 s") in text, text
    assert "spike at step 30: restored step 25, skipped batches [15, 30] (samples [[120, 240]]); rollback 1" in text


def test_only_the_current_attempt_counts(tmp_path):
    """An earlier attempt's straggler (rank 3) is forgotten; a local rerun that keeps the id is told apart by time."""
    run = make_run(tmp_path / "run")
    for rank in range(4):  # attempt 1: rank 3 slow, ends 100 s before the next starts
        write_rank(run, rank, "local.0.0", NOW - 200.0, [0.5 if rank == 3 else 0.1] * 5)
    for rank in range(3):  # attempt 2, same id: rank 1 slow; rank 3 has not started (no line since)
        write_rank(run, rank, "local.0.0", NOW - 3.0, [0.5 if rank == 1 else 0.1] * 5)
    status = build_status(run, now=NOW)
    assert status["stragglers"] == [1] and status["attempt_started"] == NOW - 3.0
    rank3 = status["ranks"][3]
    assert rank3["current"] is False and rank3["flags"] == ["not in this attempt"] and rank3["step"] == 5
    assert status["hung"] == []  # an earlier attempt's rank is not judged


def test_a_folder_that_is_no_run_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["status", str(tmp_path / "empty")]) == 2
    assert "not a run folder" in capsys.readouterr().err
    assert main(["status", str(tmp_path / "missing")]) == 2
    assert "no such folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["status", str(tmp_path), "--straggler-factor", "0"])
    assert "must be > 0" in capsys.readouterr().err


def test_states_without_markers(tmp_path):
    run = make_run(tmp_path / "run")
    assert build_status(run, now=time.time())["state"] == "starting"
    for rank in range(2):
        write_rank(run, rank, "local.0.0", NOW - 10.0, [0.1] * 4, end=True)
    assert build_status(run, now=NOW)["state"] == "finishing"  # left the loop 8 s ago: final save, validation
    stale = build_status(run, now=NOW + 1800.0)  # still no marker past parallel.startup_timeout_s
    assert stale["state"] == "failed-or-stale" and "no COMPLETED or STOPPED marker" in stale["why"]


def test_a_stopped_process_reads_as_stopped(tmp_path):
    """The process column names the rank that a hang comes from, on the node where status runs."""
    import socket

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        here = socket.gethostname()
        assert process_state(here, child.pid) == "alive" and process_state("another-node", child.pid) == ""
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while process_state(here, child.pid) != "stopped" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process_state(here, child.pid) == "stopped"
    finally:
        child.kill()
        child.wait()
    assert process_state(here, child.pid) == "gone"


def test_the_queue_has_the_last_word_on_a_slurm_job(tmp_path):
    """A Slurm job that left the queue without a marker failed (its heartbeats may still look fresh); one waiting
    in the queue (requeued) is starting, whatever its old heartbeats say; the log's last job line is shown."""
    run = make_run(tmp_path / "run")
    (run / "slurm").mkdir()
    (run / "slurm" / "14.out").write_text("[megaloop-job 2026-01-01 00:00:00] job 14 (restart 0)\nnoise\n"
                                          "[megaloop-job 2026-01-01 00:09:00] training failed (no COMPLETED)\n")
    write_rank(run, 0, "14.0.0", NOW - 2.0, [0.1])
    status = build_status(run, now=NOW)
    assert status["state"] == "failed-or-stale" and "no longer in the queue" in status["why"]
    assert status["slurm"]["last_line"].endswith("training failed (no COMPLETED)")
    assert "training failed (no COMPLETED)" in render(status)
    (run / "heartbeat" / "rank_0.jsonl").write_text("")
    write_rank(run, 0, "13.0.0", NOW - 3000.0, [0.1])  # job 13's old attempt; the job now waits in the queue
    status = build_status(run, now=NOW)
    assert status["state"] == "starting" and status["why"] == "Slurm job 13 is PENDING", status["why"]
    (run / "heartbeat" / "rank_0.jsonl").write_text("")
    write_rank(run, 0, "12.0.0", NOW - 2.0, [0.1])
    assert build_status(run, now=NOW)["state"] == "running"  # squeue lists each of its steps: RUNNING once


def test_a_submitted_slurm_job_is_a_run_before_it_writes(tmp_path, capsys):
    (tmp_path / "run" / "slurm").mkdir(parents=True)
    (tmp_path / "run" / "slurm" / "job-20260101-000000.sbatch").write_text("#!/bin/bash\n")
    assert main(["status", str(tmp_path / "run")]) == 0
    assert "starting (no rank has written a heartbeat yet" in capsys.readouterr().out
