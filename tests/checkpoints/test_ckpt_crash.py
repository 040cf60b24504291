"""A process killed with SIGKILL in the middle of a save leaves the previous checkpoint as `latest`, loadable."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from checkpoints import CheckpointError, CheckpointReader, find_checkpoints, open_newest_valid

REPO = Path(__file__).resolve().parents[2]

SAVER = """
import sys, time
from pathlib import Path
import torch
from checkpoints import Checkpointer, Piece

root = Path(sys.argv[1])

def stuck(path, data):
    (root / "writing").write_text(str(path))
    time.sleep(120)

pieces = lambda v: [Piece("model/w", (4, 2), (0, 0), torch.full((4, 2), float(v)))]
ckpt = Checkpointer(root, async_save=False)
ckpt.save(1, pieces(1), {"tokens": 1})
assert ckpt.wait().ok
ckpt.file_writer = stuck
ckpt.save(2, pieces(2), {"tokens": 2})
"""


def test_sigkill_mid_save_leaves_the_previous_checkpoint(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", SAVER, str(tmp_path)], env=env, cwd=REPO)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "writing").exists():
            assert proc.poll() is None, "the saver exited before the second save"
            assert time.monotonic() < deadline, "the second save never started writing"
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    assert (tmp_path / "latest").read_text().strip() == "step_00000001"
    assert find_checkpoints(tmp_path) == [tmp_path / "step_00000001"]
    staged = list(tmp_path.glob("step_00000002.tmp-*"))
    assert len(staged) == 1 and not (staged[0] / "COMMIT").exists()
    reader = open_newest_valid(tmp_path, on_fallback=pytest.fail)
    assert reader.step == 1 and torch.equal(reader.read("model/w"), torch.ones(4, 2))
    with pytest.raises(CheckpointError, match="no COMMIT marker"):
        CheckpointReader(staged[0])
