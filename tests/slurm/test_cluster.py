"""Jobs on the real local Slurm cluster (one node, 2 CPU processes per job, parcae-tiny at tiny sizes, fp32):
1. a submitted run completes, squeue shows it running, scontrol shows it COMPLETED (accounting is off on the local
   cluster, so there is no sacct), metrics and checkpoints are there;
2. `scancel --signal=USR1 --batch` mid-run, twice: each time every rank stops at one step and saves, the job requeues
   itself and resumes; the final per-step losses equal the uninterrupted run's bit for bit;
   `scancel JOB` (SIGTERM to every process): the ranks save, and the job is not requeued;
3. a 4-point isoFLOP job array runs to completion, each point training budget / FLOPs-per-token tokens (within one
   step), FLOPs per token from megaloop's FLOP model.
A killed, hung or always-failing rank: tests/slurm/test_recovery.py. The reference run is tests/slurm/conftest.py's."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm.sweep import budget_tag
from tests.slurm.jobs import (REFERENCE_STEPS, TINY, job_log, job_state, last_step, slurm_cli, submit,
                              tiny_overrides, train_losses, wait_gone, wait_until)

pytestmark = pytest.mark.slurm
STEPS = REFERENCE_STEPS


def test_submitted_run_completes(reference):
    job, out, seen = reference
    assert "RUNNING" in seen
    assert json.loads((out / "COMPLETED").read_text())["step"] == STEPS
    losses = train_losses(out)
    assert sorted(losses) == list(range(STEPS))
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{STEPS:08d}" and (out / "checkpoints" / latest / "COMMIT").is_file()
    log = job_log(out, job)
    assert "training completed" in log and f"job {job} (restart 0)" in log


def preempt(job: str, out: Path, after_step: int, restarts: int) -> int:
    """USR1 to the batch shell once the run has logged `after_step`; wait for the requeue; start it now."""
    wait_until(lambda: last_step(out) >= after_step, 300, f"step {after_step} of job {job}", interval=0.05)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], check=True)
    wait_until(lambda: job_state(job).get("Restarts") == str(restarts) and job_state(job)["JobState"] == "PENDING",
               120, f"job {job} to requeue")
    stopped = json.loads((out / "STOPPED").read_text())
    assert stopped["reason"] == "SIGUSR1"
    committed = (out / "checkpoints" / "latest").read_text().strip()
    assert committed == f"step_{stopped['step']:08d}"
    # skip Slurm's ~2 min requeue delay, but not within the second of the requeue: slurmd refuses a job whose
    # credential was revoked in the same second ("Job credential revoked") and the job would fail
    time.sleep(2)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=True)
    return stopped["step"]


def test_preempted_twice_requeues_and_resumes_exactly(reference, tiny_shards, tmp_path):
    _, ref_out, _ = reference
    job = submit(tiny_shards, tmp_path, "preempted", STEPS)
    out = tmp_path / "preempted"
    first = preempt(job, out, 15, restarts=1)
    wait_until(lambda: f"job {job} (restart 1)" in job_log(out, job), 120, "the requeued job to start")
    second = preempt(job, out, first + 15, restarts=2)
    wait_gone(job, 300)
    state = job_state(job)
    log = job_log(out, job)
    print(f"job {job}: stopped after steps {first} and {second}, requeued twice, JobState={state['JobState']} "
          f"Restarts={state['Restarts']}")
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "2", log
    assert 0 < first < second < STEPS
    assert log.count("requeueing job") == 2 and "training completed" in log
    losses, ref = train_losses(out), train_losses(reference[1])
    assert sorted(losses) == list(range(STEPS))
    assert losses == ref, "the resumed run's losses differ from the uninterrupted run's"
    assert ref_out != out


def test_cancelled_job_saves_and_is_not_requeued(cluster, tiny_shards, tmp_path):
    """`scancel JOB`: Slurm sends SIGTERM to every process; the ranks still save, and the job stays cancelled."""
    job = submit(tiny_shards, tmp_path, "cancelled", STEPS)
    out = tmp_path / "cancelled"
    wait_until(lambda: last_step(out) >= 15, 300, "step 15", interval=0.05)
    subprocess.run(["scancel", job], check=True)
    wait_gone(job, 60)
    state, log = job_state(job), job_log(out, job)
    stopped = json.loads((out / "STOPPED").read_text())
    print(f"job {job}: cancelled after step {stopped['step']}, JobState={state['JobState']} "
          f"Restarts={state['Restarts']}")
    assert state["JobState"] == "CANCELLED" and state["Restarts"] == "0", log
    assert stopped["reason"] == "SIGTERM" and "not requeued" in log
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step_{stopped['step']:08d}"


def test_isoflop_array_trains_budget_over_flops_per_token(cluster, tiny_shards, tmp_path):
    from megaloop.config import load_config
    from megaloop.train.flops import FlopModel

    sets = [o for o in tiny_overrides(tiny_shards, 1) if not o.startswith(("train.steps=", "checkpoint.every="))]
    budgets, mu_values = [6e9, 1.2e10], [2, 4]
    done = slurm_cli("sweep", str(TINY), "--mu-rec", ",".join(map(str, mu_values)),
                     "--flops", ",".join(map(str, budgets)), "--nodes", "1", "--procs-per-node", "2",
                     "--partition", "debug", "--time", "10", "--out-root", str(tmp_path), "--job-name", "iso",
                     "--python", sys.executable, *[a for s in sets for a in ("--set", s)])
    assert done.returncode == 0, done.stderr
    array = done.stdout.split()[-1]
    wait_gone(array, 420)
    for budget in budgets:
        for mu in mu_values:
            out = tmp_path / "iso" / f"mu{mu}-{budget_tag(budget)}"
            assert (out / "COMPLETED").is_file(), "\n".join(p.read_text()[-2000:]
                                                           for p in (tmp_path / "iso" / "slurm").glob("*.out"))
            cfg = load_config(TINY, sets + [f"model.mu_rec={mu}", "model.mu_bwd=null"])
            k = cfg.model.backprop_depth
            per_token = FlopModel.of(cfg.model).per_token(mu - k, k)
            tokens_per_step = cfg.data.global_batch_size * cfg.model.seq_len
            records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            trained = sum({r["step"]: r["tokens"] for r in records if r["kind"] == "train"}.values())
            target = budget / per_token
            print(f"mu_rec={mu} budget={budget:.3g}: FLOPs/token {per_token:.4g}, target {target:.0f} tokens, "
                  f"trained {trained} ({trained // tokens_per_step} steps)")
            assert abs(trained - target) <= tokens_per_step
    states = subprocess.run(["scontrol", "-o", "show", "job", array], capture_output=True, text=True).stdout
    assert states.count("JobState=COMPLETED") == 4, states
