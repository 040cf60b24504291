"""`python -m slurm.agent` around real torchrun (--standalone, 2 workers of a tiny script, no megaloop): a failed
worker group is restarted in a new rendezvous round whose workers can connect (gloo, as megaloop connects), and
recorded once in failures.jsonl; an agreed stop (exit 75) is not restarted; the --max-failures-th failure and a
refused input (exit 2) end the agent with the reason; a stopped (SIGSTOP) worker is ended at once when its peer
fails, not after torchrun's 30 s SIGTERM grace."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from tests.slurm.jobs import REPO, alive

WORKER = r'''
import os, signal, sys, time
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
out, mode = sys.argv[1], sys.argv[2]
with open(os.path.join(out, f"ran_{attempt}_{rank}"), "w") as f:
    f.write(str(os.getpid()))
if mode == "kill-once":  # rank 1 dies in the first round; every round connects like megaloop (tcp:// init, gloo)
    import datetime
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                            rank=rank, world_size=2, timeout=datetime.timedelta(seconds=20))
    t = torch.ones(1)
    for i in range(5):
        if rank == 1 and attempt == 0 and i == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        dist.all_reduce(t)
    dist.destroy_process_group()
elif mode == "stop":
    sys.exit(75)
elif mode in ("crash", "refuse"):
    if rank == 1:
        sys.exit(1 if mode == "crash" else 2)
    time.sleep(60)
elif mode == "hang":
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(1)
    sys.exit(1)  # as a rank whose collective timed out
'''


def agent(tmp_path: Path, mode: str, max_failures: int = 2) -> tuple[subprocess.CompletedProcess, float]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "slurm.agent", f"--failures={tmp_path / 'failures.jsonl'}",
                           "--max-failures", str(max_failures), "--standalone", "--nproc-per-node=2",
                           f"--max-restarts={max_failures}", str(script), str(tmp_path), mode],
                          cwd=REPO, capture_output=True, text=True, timeout=180)
    return done, time.monotonic() - started


def lines(tmp_path: Path) -> list[dict]:
    path = tmp_path / "failures.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def rounds(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in tmp_path.glob("ran_*"))


def test_a_killed_worker_is_restarted_in_a_new_round_that_connects(tmp_path):
    done, _ = agent(tmp_path, "kill-once")
    assert done.returncode == 0, done.stderr[-3000:]
    assert rounds(tmp_path) == ["ran_0_0", "ran_0_1", "ran_1_0", "ran_1_1"]
    [failure] = lines(tmp_path)
    assert (failure["kind"], failure["rank"], failure["round"], failure["count"]) == ("failure", 1, 0, 1)
    assert failure["cause"].startswith("death by SIGKILL")
    assert "the worker group failed: death by SIGKILL" in done.stderr


def test_an_agreed_stop_is_not_restarted(tmp_path):
    done, _ = agent(tmp_path, "stop")
    assert done.returncode == 0 and "agreed step" in done.stderr, done.stderr[-3000:]
    assert rounds(tmp_path) == ["ran_0_0", "ran_0_1"] and lines(tmp_path) == []


def test_the_max_failures_th_failure_ends_the_agent_with_the_reason(tmp_path):
    done, _ = agent(tmp_path, "crash", max_failures=2)
    assert done.returncode == 1
    assert rounds(tmp_path) == ["ran_0_0", "ran_0_1", "ran_1_0", "ran_1_1"]
    noted = lines(tmp_path)
    assert [(x["kind"], x.get("count")) for x in noted] == [("failure", 1), ("failure", 2), ("gave_up", None)]
    assert all(x["rank"] == 1 and x["cause"].startswith("exit code 1") for x in noted[:2])
    assert f"giving up: {noted[-1]['reason']}" in done.stderr
    assert noted[-1]["reason"].startswith("2 failures within 1 h reached --max-failures 2")


def test_a_refused_input_is_not_restarted(tmp_path):
    done, _ = agent(tmp_path, "refuse", max_failures=3)
    assert done.returncode == 1 and rounds(tmp_path) == ["ran_0_0", "ran_0_1"]
    assert lines(tmp_path)[-1]["reason"].startswith("rank 1 on ") and "refused its config or input (exit code 2)" in \
        lines(tmp_path)[-1]["reason"]


def test_a_stopped_worker_is_ended_when_its_peer_fails(tmp_path):
    done, took = agent(tmp_path, "hang", max_failures=1)
    stopped = int((tmp_path / "ran_0_1").read_text())
    print(f"agent done {took:.1f} s after its start (torchrun's SIGTERM grace alone is 30 s)")
    assert done.returncode == 1 and not alive(stopped)
    assert "rank 1 (pid" in done.stderr and "is stopped" in done.stderr
    assert took < 25
    [failure, _] = lines(tmp_path)
    assert failure["rank"] == 1 and failure["cause"].startswith("a hang (the process was stopped")
