"""The restart record (megaloop.train.restarts) from synthetic failures.jsonl and heartbeat files: the cause, rank and
node of the failure line, the steps lost from the failed attempt's heartbeats, the time lost by the module's
definition (worked out by hand below), each failure settled once, and the heartbeat-only fallback."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megaloop.train.metrics import validate_record
from megaloop.train.restarts import UNRECORDED, record_restarts, restart_records

T0 = 1_000_000.0  # the failed attempt's start (unix seconds)


def beat(event: str, rank: int, step: int, time: float, step_time: float | None = None, attempt="9.0.0") -> dict:
    line = {"event": event, "rank": rank, "node": f"node{rank}", "pid": 100 + rank, "attempt": attempt,
            "step": step, "time": time}
    if step_time is not None:
        line |= {"step_time": step_time, "busy_time": step_time / 2}
    return line


def write_beats(out: Path, rank: int, lines: list[dict]) -> None:
    folder = out / "heartbeat"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"rank_{rank}.jsonl", "a") as f:
        f.write("".join(json.dumps(x) + "\n" for x in lines))


def failure(out: Path, time: float, rank: int = 1, cause: str = "death by SIGKILL") -> None:
    with open(out / "failures.jsonl", "a") as f:
        f.write(json.dumps({"kind": "failure", "time": time, "job": "9", "restart": 0, "round": 0,
                            "source": "agent", "rank": rank, "node": f"node{rank}" if rank >= 0 else "",
                            "cause": cause, "count": 1, "max_failures": 3}) + "\n")


def attempt(out: Path, start: int, last: dict[int, int], step_time: float = 0.5, t0: float = T0,
            every: int = 1) -> None:
    """One attempt from `start`: rank r beats every `every` steps up to step last[r], a step each step_time s."""
    for rank, final in last.items():
        lines = [beat("start", rank, start, t0)]
        lines += [beat("step", rank, s, t0 + (s - start) * step_time, step_time)
                  for s in range(start + every, final + 1, every)]
        write_beats(out, rank, lines)


def test_a_killed_rank_costs_the_steps_past_the_checkpoint_and_the_time_since_it(tmp_path):
    attempt(tmp_path, 10, {0: 24, 1: 23})  # rank 1 killed after step 23, rank 0 got one step further
    failure(tmp_path, T0 + 14 * 0.5 + 1.0)
    now = T0 + 40.0
    [record] = restart_records(tmp_path, 20, now=now, imported_at=now - 5)
    validate_record(record)
    # steps lost: the newest heartbeat step (24, rank 0's) minus the resumed step; time lost: from when step 20 was
    # done (T0 + 10 steps x 0.5 s) to now
    assert record == {"kind": "restart", "step": 20, "attempt": 1, "cause": "death by SIGKILL", "rank": 1,
                      "node": "node1", "steps_lost": 4, "time_lost_s": pytest.approx(40.0 - 5.0)}


def test_sparse_heartbeats_are_moved_back_by_their_step_time(tmp_path):
    attempt(tmp_path, 0, {0: 25, 1: 25}, step_time=2.0, every=5)  # lines at steps 5, 10, ..., 25
    failure(tmp_path, T0 + 52.0)
    now = T0 + 100.0
    [record] = restart_records(tmp_path, 18, now=now, imported_at=now)
    # step 18 done at line 20's time minus 2 steps of 2 s: T0 + 40 - 4; lost up to now: 100 - 36 = 64 s
    assert record["steps_lost"] == 25 - 18 and record["time_lost_s"] == pytest.approx(64.0)


def test_consecutive_failures_share_no_second_and_count_the_attempts(tmp_path):
    attempt(tmp_path, 10, {0: 27, 1: 27})
    failure(tmp_path, T0 + 10.0)  # the first attempt dies at step 27
    failure(tmp_path, T0 + 30.0, rank=0, cause="exit code 1 (no error message: see the job's output)")  # at start-up
    now = T0 + 45.0
    first, second = restart_records(tmp_path, 20, now=now, imported_at=now)
    assert (first["attempt"], first["rank"], first["steps_lost"]) == (1, 1, 7)
    assert (second["attempt"], second["rank"], second["steps_lost"]) == (2, 0, 0)
    # step 20 was done at T0 + 5; the second failure at T0 + 30; now T0 + 45
    assert first["time_lost_s"] == pytest.approx(25.0) and second["time_lost_s"] == pytest.approx(15.0)
    assert first["time_lost_s"] + second["time_lost_s"] == pytest.approx(now - (T0 + 5.0))


def test_each_failure_is_settled_once_and_the_summary_lists_every_restart(tmp_path):
    attempt(tmp_path, 0, {0: 14, 1: 14})
    failure(tmp_path, T0 + 8.0)
    written = []
    run = record_restarts(tmp_path, 10, written.append, now=T0 + 20.0)
    assert [r["attempt"] for r in written] == [1] and run == written
    assert record_restarts(tmp_path, 10, written.append, now=T0 + 30.0) == run and len(written) == 1
    # a later failure of the resumed attempt (started at T0 + 25 from step 10) is the run's second restart
    attempt(tmp_path, 10, {0: 22, 1: 21}, t0=T0 + 25.0)
    failure(tmp_path, T0 + 33.0)
    run = record_restarts(tmp_path, 20, written.append, now=T0 + 50.0)
    assert [r["attempt"] for r in run] == [1, 2] and written[-1] == run[-1]
    assert run[-1]["steps_lost"] == 2 and run[-1]["time_lost_s"] == pytest.approx(50.0 - (25.0 + 5.0))


def test_an_unrecorded_failure_is_found_from_the_heartbeats(tmp_path):
    attempt(tmp_path, 0, {0: 13, 1: 12, 2: 13})  # no failures.jsonl: rank 1's heartbeat stopped first
    now = T0 + 30.0
    [record] = restart_records(tmp_path, 10, now=now, imported_at=now - 1)
    assert record["cause"] == UNRECORDED and (record["rank"], record["node"]) == (1, "node1")
    assert record["steps_lost"] == 3 and record["time_lost_s"] == pytest.approx(30.0 - 5.0)


def test_a_failure_without_a_rank_names_the_rank_whose_heartbeat_stopped_first(tmp_path):
    attempt(tmp_path, 0, {0: 13, 1: 11})
    failure(tmp_path, T0 + 8.0, rank=-1, cause="the end of the whole training step")
    [record] = restart_records(tmp_path, 10, now=T0 + 9.0, imported_at=T0 + 9.0)
    assert (record["rank"], record["node"], record["cause"]) == (1, "node1", "the end of the whole training step")


def test_no_record_after_a_clean_end_or_for_the_current_attempts_lines(tmp_path):
    attempt(tmp_path, 0, {0: 10, 1: 10})
    write_beats(tmp_path, 0, [beat("end", 0, 10, T0 + 5.5)])
    write_beats(tmp_path, 1, [beat("end", 1, 10, T0 + 5.5)])
    assert restart_records(tmp_path, 10, now=T0 + 60, imported_at=T0 + 60) == []
    # lines written after this process started are the current attempt's, not a failed one's
    attempt(tmp_path, 10, {0: 11, 1: 11}, t0=T0 + 70.0)
    assert restart_records(tmp_path, 10, now=T0 + 80, imported_at=T0 + 69) == []


def test_a_clean_stop_before_a_start_up_crash_costs_no_steps(tmp_path):
    """Stopped and saved at step 10 (an agreed stop), then the requeued attempt crashed at start-up."""
    attempt(tmp_path, 0, {0: 10, 1: 10})
    for rank in (0, 1):
        write_beats(tmp_path, rank, [beat("end", rank, 10, T0 + 5.5)])
    failure(tmp_path, T0 + 200.0)
    [record] = restart_records(tmp_path, 10, now=T0 + 210.0, imported_at=T0 + 210.0)
    assert record["steps_lost"] == 0 and record["time_lost_s"] == pytest.approx(10.0)
