"""The failure log and its policy (slurm/failures.py), without a cluster: which rank is blamed when several failed at
once, the budget over a window of one hour, the batch script's decision after a step that left no marker, and the
agent's reading of a worker's process state."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from slurm.agent import process_status, split_options
from slurm.failures import (FailureLog, WorkerOutcome, blame, describe, failures_within, first_line, read,
                            step_ended)

CLOSED = "RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1152. This is typically caused by ..."
TIMED_OUT = "RuntimeError: [unbound_buffer.cc:78] Timed out waiting 20000ms for recv operation to complete"


@pytest.mark.parametrize("outcomes, rank, cause", [
    # kill -9 of rank 1: rank 0's collective fails at once with a closed connection
    ([WorkerOutcome(0, "a", 1, message=CLOSED), WorkerOutcome(1, "a", -9)], 1, "death by SIGKILL"),
    # SIGSTOP of rank 1: rank 0 times out, rank 1 is found stopped
    ([WorkerOutcome(0, "a", 1, message=TIMED_OUT), WorkerOutcome(1, "b", None, stopped=True)], 1,
     "a hang (the process"),
    # a rank stuck in a kernel: the others time out, it still runs
    ([WorkerOutcome(0, "a", 1, message=TIMED_OUT), WorkerOutcome(1, "a", None), WorkerOutcome(2, "a", -6)], 1,
     "a hang (no progress"),
    # a Python error on rank 2 while the others wait
    ([WorkerOutcome(0, "a", None), WorkerOutcome(1, "a", None), WorkerOutcome(2, "a", 1, message="ValueError: x")], 2,
     "an error (ValueError: x)"),
    # the NCCL watchdog's abort ranks below a rank's own error
    ([WorkerOutcome(0, "a", -6), WorkerOutcome(1, "a", 1, message="KeyError: 'w'")], 1, "an error (KeyError"),
    # a bare exit (os._exit(1), no error file) outranks a launcher's SIGTERM; a tie goes to the lowest rank
    ([WorkerOutcome(0, "a", -15), WorkerOutcome(1, "a", 1), WorkerOutcome(2, "a", 1)], 1, "exit code 1"),
    ([WorkerOutcome(0, "a", 1, message=CLOSED), WorkerOutcome(1, "a", 1, message=CLOSED)], 0,
     "a communication error"),
])
def test_the_rank_blamed_is_the_cause_not_its_peers(outcomes, rank, cause):
    blamed = blame(outcomes)
    assert blamed.rank == rank and describe(blamed).startswith(cause), describe(blamed)


def test_nobody_is_blamed_when_every_rank_still_runs():
    assert blame([WorkerOutcome(0, "a", None), WorkerOutcome(1, "a", None)]) is None


def test_an_error_file_message_becomes_one_line():
    assert first_line({"message": "ValueError: bad\nmore", "extraInfo": {}}) == "ValueError: bad"
    assert first_line("Traceback (most recent call last):\n  File x\nKeyError: 'k'") == "KeyError: 'k'"
    assert first_line("To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html") == ""


def test_the_budget_counts_failures_within_the_hour_and_gives_up_at_the_maximum(tmp_path):
    log = FailureLog(tmp_path / "failures.jsonl", max_failures=3)
    now = time.time()
    blamed = WorkerOutcome(1, "node7", -9)
    assert log.record(blamed, "death by SIGKILL", "agent", now=now - 4000) is None  # more than an hour ago
    with open(log.path, "a") as f:
        f.write('{"kind": "failure", "ti')  # torn by a crash: skipped
    assert log.record(blamed, "death by SIGKILL", "agent", now=now - 10) is None
    assert log.record(blamed, "death by SIGKILL", "agent", now=now - 5) is None
    reason = log.record(blamed, "death by SIGKILL", "agent", now=now)
    assert reason.startswith("3 failures within 1 h reached --max-failures 3, the last: death by SIGKILL (rank 1 "
                             "on node7)") and "\n" not in reason
    lines = read(log.path)
    assert [x["count"] for x in lines if x["kind"] == "failure"] == [1, 1, 2, 3]
    assert lines[-1]["kind"] == "gave_up" and lines[-1]["reason"] == reason
    assert failures_within(lines, now) == 3
    assert log.verdict_since(now - 1, environ={"SLURM_JOB_ID": "local"}) == reason
    assert log.verdict_since(now - 1, environ={"SLURM_JOB_ID": "42"}) is None  # another job's verdict
    assert log.verdict_since(now + 1) is None


def test_a_step_that_died_without_a_verdict_is_counted_and_requeued(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    beats = tmp_path / "heartbeat"
    beats.mkdir()
    for rank, t in ((0, 105.0), (1, 101.0)):  # rank 1's heartbeat stopped first
        (beats / f"rank_{rank}.jsonl").write_text(json.dumps({"event": "step", "rank": rank, "node": f"n{rank}",
                                                              "step": 9, "time": t}) + "\n")
    path = tmp_path / "failures.jsonl"
    action, text = step_ended(path, 2, since=time.time() - 5, exit_code=137)
    assert action == "requeue" and text.startswith("failure 1 within 1 h (--max-failures 2)")
    assert "the rank that stopped first: 1 on n1" in text
    [line] = read(path)
    assert (line["source"], line["rank"], line["node"], line["job"]) == ("step", 1, "n1", "77")
    action, text = step_ended(path, 2, since=time.time() - 5, exit_code=1)
    assert action == "fail" and text.startswith("2 failures within 1 h reached --max-failures 2")
    assert read(path)[-1]["kind"] == "gave_up"


def test_the_agents_verdict_ends_the_job_and_a_clean_exit_is_not_restarted(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    path = tmp_path / "failures.jsonl"
    since = time.time()
    FailureLog(path, 3).give_up("the agent's reason")
    assert step_ended(path, 3, since=since, exit_code=1) == ("fail", "the agent's reason")
    assert len(read(path)) == 1  # nothing more counted
    action, text = step_ended(tmp_path / "other.jsonl", 3, since=since, exit_code=0)
    assert action == "fail" and "exited 0 without a COMPLETED or STOPPED marker" in text


def test_the_batch_script_helper_prints_one_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "slurm.failures", "step-ended", str(tmp_path / "f.jsonl"),
                           "--max-failures", "1", "--since", "0", "--exit-code", "1"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.count("\n") == 1 and done.stdout.startswith("fail 1 failure within 1 h")


def test_the_agent_reads_its_own_options_and_leaves_torchruns():
    own, rest = split_options(["--failures=/r/f.jsonl", "--max-failures", "5", "--nnodes=1", "-m", "megaloop"])
    assert own == {"failures": "/r/f.jsonl", "max_failures": 5} and rest == ["--nnodes=1", "-m", "megaloop"]
    with pytest.raises(SystemExit, match="--max-failures '0': must be an integer >= 1"):
        split_options(["--max-failures=0"])


def test_process_status_tells_stopped_exited_and_gone():
    child = subprocess.Popen(["sleep", "30"])
    try:
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while process_status(child.pid)[0] != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_status(child.pid) == ("T", None)
        child.kill()
        while process_status(child.pid)[0] != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_status(child.pid) == ("Z", -9)  # not reaped yet: Popen would read the same code
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -9 and process_status(child.pid) == ("", None)
    exits = subprocess.Popen(["sh", "-c", "exit 3"])
    deadline = time.monotonic() + 10
    while process_status(exits.pid)[0] != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert process_status(exits.pid) == ("Z", 3) and exits.wait() == 3


def test_with_several_nodes_only_the_first_agent_of_a_failed_round_records_it():
    from types import SimpleNamespace

    from slurm.agent import _first_in_round

    class RoundStore:  # the counter of torchrun's per-round rendezvous store
        def __init__(self):
            self.n = 0

        def add(self, key: str, value: int) -> int:
            self.n += value
            return self.n

    store = RoundStore()
    assert _first_in_round(SimpleNamespace(group_world_size=2, store=store))
    assert not _first_in_round(SimpleNamespace(group_world_size=2, store=store))
    assert _first_in_round(SimpleNamespace(group_world_size=1, store=None))
