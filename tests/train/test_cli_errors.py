"""Bad input to `python -m megaloop train` fails with a clear message (exit 2) before any heavy work: no output
directory is created and no model is built."""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _train(*args, cwd):
    return subprocess.run([sys.executable, "-m", "megaloop", "train", str(REPO / "configs" / "parcae-tiny.yaml"),
                           *args], capture_output=True, text=True, cwd=REPO, timeout=120)


@pytest.mark.parametrize("overrides,expected", [
    (["train.stesp=5"], "train.stesp=5: unknown key (did you mean 'steps'?)"),
    (["train.steps=five"], "train.steps='five': must be an integer"),
    (["data.global_batch_size=12"], "data.global_batch_size=12: must be divisible by data.micro_batch_size x dp"),
    (["data.shards=/nonexistent/shards"], "data.shards='/nonexistent/shards': is not a shard directory"),
    ([], "data.shards=None: set it to a directory written by `python -m data_prep shards`"),
])
def test_bad_input_is_named_before_work(overrides, expected, tmp_path):
    out = tmp_path / "out"
    args = [a for o in overrides + [f"train.out_dir={out}"] for a in ("--set", o)]
    proc = _train(*args, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists(), "nothing may be written for a bad config"


def test_help_lists_commands():
    proc = subprocess.run([sys.executable, "-m", "megaloop", "train", "--help"], capture_output=True, text=True,
                          cwd=REPO, timeout=60)
    assert proc.returncode == 0 and "--set KEY=VALUE" in proc.stdout
