"""Acceptance 7 of issue 32: `megaloop status` on a running dp 4 job (4 CPU processes under `megaloop launch`) in
which rank 2 sleeps 0.3 s in every step (MEGALOOP_FAULTS) names rank 2 as the straggler and no other rank. Run with
-s to see the status it printed."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.process_group import kill_group
from tests.train.conftest import TINY, fast_overrides

REPO = Path(__file__).resolve().parents[2]
SLEEP_S = 0.3
LINES = 6  # step lines every rank has written before status is asked (more than its window of 5)


def launch(shards: Path, out: Path) -> subprocess.Popen:
    sets = fast_overrides(shards, out, steps=40) + ["train.heartbeat_every=1", "train.val_every=1000",
                                                     "train.val_depths=[2]", "data.val_batches=1",
                                                     "data.micro_batch_size=2"]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1",
               MEGALOOP_FAULTS=f"slow:rank=2,seconds={SLEEP_S}")
    cmd = [sys.executable, "-m", "megaloop", "launch", "--nproc-per-node", "4", str(TINY)]
    return subprocess.Popen(cmd + [a for s in sets for a in ("--set", s)], cwd=REPO, env=env, text=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def step_lines(out: Path) -> list[int]:
    files = [out / "heartbeat" / f"rank_{r}.jsonl" for r in range(4)]
    return [sum('"event": "step"' in x for x in f.read_text().splitlines()) if f.exists() else 0 for f in files]


def status(out: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megaloop", "status", str(out), *extra], cwd=REPO, text=True,
                          capture_output=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(REPO)))


@pytest.mark.multiproc
def test_status_names_the_slowed_rank_of_a_running_dp4_job(tiny_shards, tmp_path):
    out = tmp_path / "run"
    job = launch(tiny_shards, out)
    try:
        deadline = time.monotonic() + 120
        while min(step_lines(out)) < LINES and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert min(step_lines(out)) >= LINES, f"too few heartbeats {step_lines(out)}, job exit {job.poll()}"
        text, report = status(out), status(out, "--json")
        _, err = job.communicate(timeout=180)
    finally:
        kill_group(job)  # on a failure or a timeout, no worker outlives the test
    print(f"\n$ python -m megaloop status {out}\n{text.stdout}")
    assert text.returncode == 0 and report.returncode == 0, text.stderr + report.stderr
    assert job.returncode == 0, err
    got = json.loads(report.stdout)
    assert got["state"] == "running" and got["stragglers"] == [2] and got["hung"] == [], got
    assert "rank 2 (" in text.stdout and "factor 1.5" in text.stdout, text.stdout
    ranks = {r["rank"]: r for r in got["ranks"]}
    assert sorted(ranks) == [0, 1, 2, 3] and all(r["current"] for r in ranks.values())
    # independent of status's rule: rank 2's own time holds the injected sleep; the others' does not, yet every
    # rank's wall step time does (they wait for rank 2 at the step's reduction)
    assert ranks[2]["busy_time"] >= SLEEP_S and all(ranks[r]["busy_time"] < SLEEP_S for r in (0, 1, 3))
    assert all(r["step_time"] >= SLEEP_S for r in ranks.values())
    done = json.loads(status(out, "--json").stdout)
    assert done["state"] == "completed" and done["hung"] == [], done
