"""A URL given where a local path is expected is refused (exit 2, naming the option that takes URLs where there is
one) instead of writing a folder named `s3:` in the current directory and reporting success."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
URL = "s3://bucket/x"

CASES = [
    (["data_prep", "shards", "--input", "in", "--tokenizer", "tok", "--output", URL, "--seq-len", "8"],
     "argument --output", "give it to --out"),
    (["data_prep", "tokenizer", "--input", "in", "--output", URL], "argument --output", "takes a local path"),
    (["data_prep", "shards", "--input", "in", "--tokenizer", URL, "--output", "o", "--seq-len", "8"],
     "argument --tokenizer", "takes a local path"),
    (["data_prep", "upload", URL, "s3://bucket/y"], "argument local_dir", "give it to the URL argument"),
    (["data_prep", "reindex", "--shards", URL], "argument --shards", "takes a local path"),
    (["checkpoints", "verify", URL], "argument DIR", "takes a local path"),
    (["checkpoints", "export", URL, "--out", "m.safetensors"], "argument CKPT_DIR", "takes a local path"),
    (["megaloop", "eval", URL], "argument RUN_DIR|CHECKPOINT", "takes a local path"),
    (["megaloop", "check", "configs/parcae-tiny.yaml", "--set", f"train.out_dir={URL}"], "train.out_dir",
     "takes a local path"),
    (["megaloop", "check", "configs/parcae-tiny.yaml", "--set", f"checkpoint.resume={URL}"], "checkpoint.resume",
     "takes a local path"),
]


@pytest.mark.parametrize("argv,where,what", CASES, ids=[" ".join(c[0][:2]) + f"-{i}" for i, c in enumerate(CASES)])
def test_url_for_a_local_path_is_refused(tmp_path, argv, where, what):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [a if a != "configs/parcae-tiny.yaml" else str(REPO / a) for a in argv[1:]]
    proc = subprocess.run([sys.executable, "-m", argv[0], *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert where in proc.stderr and what in proc.stderr and URL in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []  # no folder named "s3:" (nor anything else) was written
