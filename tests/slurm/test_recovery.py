"""Recovery without a person, on the local Slurm cluster (one node, 2 CPU processes per job, parcae-tiny at tiny
sizes, fp32, checkpoint.every=10, heartbeats every step), against the uninterrupted reference run of
tests/slurm/conftest.py:
- Kill: `kill -9` of rank 1 at a random time, with checkpoints by the clock (checkpoint.every_minutes=0.05).
  slurm.agent restarts the workers inside the same job (no requeue), they resume from the last committed checkpoint
  and the job completes by itself; its per-step losses equal the reference's bit for bit; the "restart" record
  (metrics.jsonl and summary.json) names the cause, rank 1 and its node, and its steps lost match the steps the killed
  attempt logged after that checkpoint; the training lost is at most one interval (plus a step).
- Hang: SIGSTOP of rank 1 under parallel.timeout_s=20: both processes are gone within timeout_s + 30 s of the stop,
  and the job recovers as above.
- Bounded: a crash at every start (MEGALOOP_FAULTS=crash:rank=1,at=start, through `--env`) in a run whose earlier
  job committed a checkpoint: the job ends FAILED after --max-failures attempts, its log says why in one line, and the
  checkpoint is untouched (the same files, the same bytes).
- Spike: train.on_spike=stop with a corrupted batch: the newest checkpoint is from before the spike, and the job
  is not requeued.
- A dead agent (the whole training step died): the batch script counts the failure and requeues the job, which
  resumes from the last committed checkpoint and completes with the reference's losses.
Each test prints the figures: the step of the fault, the seconds until every rank was gone, the steps and seconds
lost."""
from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.slurm.jobs import (REFERENCE_STEPS, agent_pid, alive, job_log, job_state, last_step, metrics, submit,
                              train_losses, wait_gone, wait_until, worker_pids)

pytestmark = pytest.mark.slurm
STEPS = REFERENCE_STEPS
BEATS = ("--set", "train.heartbeat_every=1")  # heartbeats every step: steps lost to within one step


def both_workers(out: Path) -> dict[int, int]:
    return wait_until(lambda: p if len(p := worker_pids(out)) == 2 else None, 60, "both training processes")


def gone_after(pids: dict[int, int], since: float, timeout: float) -> float:
    """Seconds from `since` (time.monotonic) until every one of `pids` has exited."""
    wait_until(lambda: not any(alive(p) for p in pids.values()), timeout, "every rank to exit", interval=0.1)
    return time.monotonic() - since


def recovered(reference, out: Path, job: str, fault_at_unix: float, requeues: int = 0, ranks=(1,),
              every: int = 10) -> dict:
    """Checks of a job that recovered from one failure (blamed on one of `ranks`; checkpoints every `every` steps,
    0: by the clock); its restart record."""
    state, log = job_state(job), job_log(out, job)
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == str(requeues), log
    assert train_losses(out) == train_losses(reference[1]), "the recovered run's losses differ from the reference's"
    records = metrics(out)
    restarts = [i for i, r in enumerate(records) if r["kind"] == "restart"]
    assert len(restarts) == 1, records[-5:]
    restart = records[restarts[0]]
    resumed = restart["step"]
    assert (resumed % every == 0 if every else True) and 0 < resumed < STEPS
    # independent of the heartbeats: the steps the failed attempt logged after the checkpoint it resumed from (its
    # heartbeat of a step is written just before the step's metrics record, so the heartbeats may count one more)
    logged = max(r["step"] for r in records[:restarts[0]] if r["kind"] == "train") + 1 - resumed
    assert logged <= restart["steps_lost"] <= logged + 1, (restart, logged)
    assert restart["rank"] in ranks and restart["node"] == socket.gethostname() and restart["attempt"] == 1
    failures = [json.loads(line) for line in (out / "failures.jsonl").read_text().splitlines()]
    noted = [f for f in failures if f["kind"] == "failure"]
    assert len(noted) == 1 and noted[0]["count"] == 1 and noted[0]["cause"] == restart["cause"]
    # the clock: from the checkpointed step (before the fault) to the restart, so at least fault -> agent's note
    assert noted[0]["time"] - fault_at_unix <= restart["time_lost_s"] < time.time() - fault_at_unix + 300
    summary = json.loads((out / "summary.json").read_text())
    assert summary["restarts"] == [restart]
    return restart


def work_lost_s(out: Path, resumed: int, fault_at_unix: float) -> tuple[float, float]:
    """From the failed attempt's heartbeats (rank 0's, every step): the seconds of training between the step the
    job resumed from and the last step that finished before the fault, and the slowest step."""
    from megaloop.train.heartbeat import read_heartbeats

    beats = [b for b in read_heartbeats(out)[0] if b["event"] == "step" and b["time"] <= fault_at_unix]
    at = {b["step"]: b["time"] for b in beats}
    return max(at.values()) - at[resumed], max(b["step_time"] for b in beats)


def test_killed_rank_restarts_in_the_job_and_resumes_exactly(reference, tiny_shards, tmp_path):
    """Checkpoints by the clock alone (checkpoint.every_minutes=0.05, checkpoint.every=0; steps slowed by 0.05 s so
    that the kill lands inside the run): besides the recovery, the work lost is at most one interval (plus a step,
    and the write of a save in flight)."""
    interval = 0.05 * 60
    kill_after_s = random.uniform(1.3, 3.0) * interval  # a random time after the first step (printed)
    job = submit(tiny_shards, tmp_path, "killed", STEPS, *BEATS, "--set", "checkpoint.every=0", "--set",
                 "checkpoint.every_minutes=0.05", "--env", "MEGALOOP_FAULTS=slow:rank=0,seconds=0.05")  # ~10 s run
    out = tmp_path / "killed"
    pids = both_workers(out)
    wait_until(lambda: last_step(out) >= 0, 300, "the first step", interval=0.02)
    time.sleep(kill_after_s)
    killed_at, killed_unix, kill_after = time.monotonic(), time.time(), last_step(out)
    os.kill(pids[1], signal.SIGKILL)
    gone_s = gone_after(pids, killed_at, 60)
    wait_gone(job, 300)
    assert kill_after < STEPS - 1, "the run finished before the kill"
    restart = recovered(reference, out, job, killed_unix, every=0)
    lost_s, step_s = work_lost_s(out, restart["step"], killed_unix)
    print(f"job {job}: rank 1 killed (SIGKILL) {kill_after_s:.1f} s after the first step, after step {kill_after}; "
          f"every rank of that attempt gone "
          f"{gone_s:.1f} s later; resumed in the same job at step {restart['step']} after {restart['cause']}: "
          f"{restart['steps_lost']} steps and {restart['time_lost_s']:.1f} s lost; training lost {lost_s:.2f} s "
          f"(checkpoint.every_minutes={interval / 60:g}: {interval:g} s; slowest step {step_s:.2f} s)")
    assert lost_s <= interval + 2 * step_s
    assert "death by SIGKILL" in restart["cause"]
    assert "the worker group failed: death by SIGKILL" in job_log(out, job)


def test_hung_rank_ends_every_rank_within_the_timeout_and_recovers(reference, tiny_shards, tmp_path):
    timeout_s = 20
    job = submit(tiny_shards, tmp_path, "hung", STEPS, *BEATS, "--set", f"parallel.timeout_s={timeout_s}")
    out = tmp_path / "hung"
    pids = both_workers(out)
    wait_until(lambda: last_step(out) >= 24, 300, "step 24", interval=0.02)  # between two saves (every 10 steps)
    stopped_at, stopped_unix, stop_step = time.monotonic(), time.time(), last_step(out)
    os.kill(pids[1], signal.SIGSTOP)
    gone_s = gone_after(pids, stopped_at, timeout_s + 60)
    wait_gone(job, 300)
    restart = recovered(reference, out, job, stopped_unix)
    print(f"job {job}: rank 1 stopped (SIGSTOP) after step {stop_step}; parallel.timeout_s={timeout_s}: "
          f"every rank gone {gone_s:.1f} s later (bound {timeout_s + 30} s); resumed at step {restart['step']} after "
          f"{restart['cause']}: {restart['steps_lost']} steps and {restart['time_lost_s']:.1f} s lost")
    assert gone_s <= timeout_s + 30
    assert restart["cause"].startswith("a hang")


def checkpoint_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_crash_at_every_start_ends_the_job_failed_after_max_failures(cluster, tiny_shards, tmp_path):
    good = submit(tiny_shards, tmp_path, "bounded", 20)
    out = tmp_path / "bounded"
    wait_gone(good, 300)
    assert job_state(good)["JobState"] == "COMPLETED", job_log(out, good)
    before = checkpoint_digest(out / "checkpoints")
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000020"

    started = time.monotonic()
    job = submit(tiny_shards, tmp_path, "bounded", 40, "--max-failures", "3",
                 "--env", "MEGALOOP_FAULTS=crash:rank=1,at=start")
    wait_gone(job, 300)
    took = time.monotonic() - started
    state, log = job_state(job), job_log(out, job)
    reason = [line for line in log.splitlines() if "training failed:" in line]
    failures = [json.loads(line) for line in (out / "failures.jsonl").read_text().splitlines()]
    print(f"job {job}: JobState={state['JobState']} after {took:.0f} s and "
          f"{sum(f['kind'] == 'failure' for f in failures)} failed attempts; the log's reason: {reason}")
    assert state["JobState"] == "FAILED" and state["Restarts"] == "0", log
    assert [f["count"] for f in failures if f["kind"] == "failure"] == [1, 2, 3]
    assert all(f["rank"] == 1 and f["cause"].startswith("exit code 1") for f in failures if f["kind"] == "failure")
    assert len(reason) == 1 and "3 failures within 1 h reached --max-failures 3" in reason[0]
    assert "rank 1 on" in reason[0] and log.count("injected fault") == 3
    assert checkpoint_digest(out / "checkpoints") == before, "the last good checkpoint changed"


def test_a_dead_agent_requeues_the_job_which_resumes(reference, tiny_shards, tmp_path):
    job = submit(tiny_shards, tmp_path, "agentless", STEPS, *BEATS)
    out = tmp_path / "agentless"
    both_workers(out)
    wait_until(lambda: last_step(out) >= 15, 300, "step 15", interval=0.02)
    agent = agent_pid(out)
    killed_unix = time.time()
    os.kill(agent, signal.SIGKILL)
    wait_until(lambda: job_state(job).get("Restarts") == "1" and job_state(job)["JobState"] == "PENDING", 120,
               f"job {job} to requeue")
    time.sleep(2)  # not within the second of the requeue (see test_cluster.preempt)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)
    wait_gone(job, 300)
    log = job_log(out, job)
    line = next(x for x in log.splitlines() if "training failed:" in x)
    print(f"job {job}: its torchrun agent killed after step 15; the batch script: {line.split('] ', 1)[1]}")
    assert "requeueing job" in line and "without a verdict from slurm.agent" in line
    restart = recovered(reference, out, job, killed_unix, requeues=1, ranks=(0, 1))
    print(f"resumed at step {restart['step']}: {restart['steps_lost']} steps and {restart['time_lost_s']:.1f} s "
          "lost (the Slurm requeue included)")


def test_spike_stop_keeps_the_pre_spike_checkpoint_and_is_not_requeued(cluster, tiny_shards, tmp_path):
    """train.on_spike=stop with the batch of step 25 corrupted (MEGALOOP_FAULTS=spike:step=25): nothing is saved
    after the spike, the newest checkpoint is step 20's (checkpoint.every=10), the STOPPED marker says not to
    requeue, and the batch script does not requeue the job."""
    job = submit(tiny_shards, tmp_path, "spike", STEPS, "--set", "train.on_spike=stop", "--set",
                 "train.spike_window=20", "--env", "MEGALOOP_FAULTS=spike:step=25")
    out = tmp_path / "spike"
    wait_gone(job, 300)
    state, log = job_state(job), job_log(out, job)
    spikes = [r for r in metrics(out) if r["kind"] == "spike"]
    stopped = json.loads((out / "STOPPED").read_text())
    latest = (out / "checkpoints" / "latest").read_text().strip()
    print(f"job {job}: spike at step {[s['step'] for s in spikes]}, STOPPED {stopped}, latest {latest}, "
          f"JobState={state['JobState']} Restarts={state['Restarts']}")
    assert [s["step"] for s in spikes] == [25] and spikes[0]["action"] == "stop", log
    assert stopped["requeue"] is False and stopped["step"] == 20
    assert latest == "step_00000020"
    assert not any(p.name.startswith("step_") and int(p.name[5:13]) > 20 and (p / "COMMIT").exists()
                   for p in (out / "checkpoints").iterdir())
    assert state["Restarts"] == "0" and "not to be requeued" in log and "requeueing" not in log
    assert state["JobState"] == "FAILED"  # exit 75: the run stopped and waits for a person
