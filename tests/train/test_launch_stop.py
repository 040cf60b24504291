"""`python -m megaloop launch` with 2 real processes: an agreed stop (train.stop_at_step, or Ctrl-C reaching the
launcher) is one line and exit code 75, not torchrun's traceback and exit 1; the same command then continues."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.train.conftest import TINY, fast_overrides

REPO = Path(__file__).resolve().parents[2]
STOP_EXIT_CODE = 75


def launch(shards, out: Path, steps: int, *extra: str) -> subprocess.Popen:
    sets = fast_overrides(shards, out, steps) + ["train.val_depths=[2]", "data.val_batches=1", *extra]
    cmd = [sys.executable, "-m", "megaloop", "launch", "--nproc-per-node", "2", str(TINY)]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd + [a for s in sets for a in ("--set", s)], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    _, err = proc.communicate(timeout=300)
    return proc.returncode, err


def assert_clean_stop(code: int, err: str, step: int, reason: str) -> None:
    assert code == STOP_EXIT_CODE, err
    assert "Traceback" not in err and "ChildFailedError" not in err, err
    assert err.strip().splitlines()[-1] == (f"megaloop launch: the workers stopped cleanly after step {step} "
                                            f"({reason}) and saved; run the same command again to continue "
                                            f"(exit code {STOP_EXIT_CODE})")


def test_stop_at_step_exits_75_in_one_line_and_the_same_command_continues(tiny_shards, tmp_path):
    code, err = finish(launch(tiny_shards, tmp_path, 4, "train.stop_at_step=2"))
    assert_clean_stop(code, err, 2, "train.stop_at_step=2")
    code, err = finish(launch(tiny_shards, tmp_path, 4))
    assert code == 0, err
    assert json.loads((tmp_path / "COMPLETED").read_text()) == {"step": 4}


def test_ctrl_c_to_the_launcher_saves_and_exits_75(tiny_shards, tmp_path):
    proc = launch(tiny_shards, tmp_path, 500)
    metrics = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)  # what Ctrl-C sends to the foreground process (the workers are in own sessions)
    code, err = finish(proc)
    step = json.loads((tmp_path / "STOPPED").read_text())["step"]
    assert_clean_stop(code, err, step, "SIGINT")


def test_bad_data_exits_2_with_the_error_once(tiny_shards, tmp_path):
    """Every rank refuses a shard set whose shard does not match its manifest: the launcher exits 2 (not torchrun's
    1) and shows the one-line error once, not once per rank plus the agent's failure records."""
    import shutil

    shards = tmp_path / "shards"
    shutil.copytree(tiny_shards, shards)
    shard = sorted(shards.glob("train-*.tar"))[0]
    with open(shard, "ab") as f:
        f.write(b"\0" * 512)  # a size the manifest does not list
    code, err = finish(launch(shards, tmp_path / "run", 4))
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("megaloop:")]
    assert len(errors) == 1 and shard.name in errors[0], err
    assert "exitcode" not in err and "closing signal" not in err and "Traceback" not in err, err
