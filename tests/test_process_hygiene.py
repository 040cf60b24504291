"""A multi-process test that times out leaves no worker behind, and pytest exits.

Each case runs an inner pytest session (a subprocess) whose one test starts workers that would sleep for 10 minutes
and record their PIDs, under a short pytest-timeout (long enough for the workers to import torch on a busy 2-core
machine); the outer test checks that the inner session ended on its own (within 120 s of it) and that every recorded worker is gone. On the spawn helper as it was (torch's mp.spawn joining with
no clean-up), the timed-out workers kept running and the inner pytest waited for them at exit."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

INNER_SPAWN = """
from tests.pipeline.spawn import spawn
from tests.test_process_hygiene import sleeping_worker

def test_hangs(tmp_path):
    spawn(sleeping_worker, 2, {pid_dir!r})
"""

INNER_GROUP = """
from tests.process_group import run_group

def test_hangs():
    run_group(["bash", "-c", "sleep 600 & echo $! > {pid_dir}/bg.pid; echo $$ > {pid_dir}/bash.pid; sleep 600"])
"""


def sleeping_worker(rank: int, world_size: int, pid_dir: str) -> None:
    Path(pid_dir, f"rank{rank}.pid").write_text(str(os.getpid()))
    time.sleep(600)


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (an exited child that nobody reaped yet has ended all the same)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def still_alive(pids: list[int], grace_s: float) -> list[int]:
    """The pids still alive after up to grace_s: a worker killed by PR_SET_PDEATHSIG when its parent exits gets
    its SIGKILL asynchronously, and may still be exiting when the parent's exit is seen."""
    deadline = time.monotonic() + grace_s
    while True:
        survivors = [pid for pid in pids if alive(pid)]
        if not survivors or time.monotonic() >= deadline:
            return survivors
        time.sleep(0.05)


def run_inner(tmp_path: Path, body: str, method: str, expect_pids: int, timeout_s: int) -> tuple:
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "test_inner.py").write_text(body.format(pid_dir=str(pid_dir)))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--timeout={timeout_s}",
           f"--timeout-method={method}", str(inner / "test_inner.py")]
    proc = subprocess.Popen(cmd, cwd=inner, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s + 120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        pytest.fail(f"the inner pytest did not exit within 120 s of its {timeout_s} s timeout:\n{out[-3000:]}")
    finally:
        pids = [int(p.read_text()) for p in sorted(pid_dir.glob("*.pid"))]
        survivors = still_alive(pids, grace_s=5.0)
        for pid in survivors:  # never leave them to the rest of the suite, whatever the verdict
            os.kill(pid, 9)
    assert len(pids) == expect_pids, f"the workers did not all start before the timeout:\n{out[-3000:]}"
    return subprocess.CompletedProcess(cmd, proc.returncode, out), survivors


@pytest.mark.multiproc
@pytest.mark.parametrize("method", ["signal", "thread"])
def test_timed_out_spawn_leaves_no_worker(tmp_path, method):
    """signal: pytest-timeout raises inside the join and the helper kills its workers; thread: pytest-timeout ends
    pytest with os._exit, and the workers die with their parent (PR_SET_PDEATHSIG)."""
    done, survivors = run_inner(tmp_path, INNER_SPAWN, method, expect_pids=2, timeout_s=30)
    print(f"{method}: inner pytest rc {done.returncode}, surviving workers {survivors}")
    assert done.returncode != 0 and "Timeout" in done.stdout, done.stdout[-3000:]
    assert survivors == [], f"workers outlived the timed-out test: {survivors}"


def test_timed_out_command_leaves_no_process_of_its_group(tmp_path):
    done, survivors = run_inner(tmp_path, INNER_GROUP, "signal", expect_pids=2, timeout_s=5)
    print(f"run_group: inner pytest rc {done.returncode}, surviving processes {survivors}")
    assert done.returncode != 0 and "Timeout" in done.stdout, done.stdout[-3000:]
    assert survivors == [], f"processes of the command outlived the timed-out test: {survivors}"
