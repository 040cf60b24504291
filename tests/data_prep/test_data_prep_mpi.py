"""MPI preparation: mpirun -n 1, 2 and 4 write byte-identical shards and manifest."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from data_prep.prepare import ShardOptions, prepare_shards

from dp_testing import SEQ_LEN
from tests.process_group import run_group

REPO = Path(__file__).resolve().parents[2]
MPIRUN = shutil.which("mpirun")
pytestmark = [
    pytest.mark.multiproc,
    pytest.mark.skipif(MPIRUN is None, reason="mpirun not installed (apt-get install libopenmpi-dev openmpi-bin)"),
    pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="mpi4py not installed (pip install "
                       "mpi4py==4.1.2)"),
]


def _mpirun(ranks: int, *args: str) -> subprocess.CompletedProcess:
    command = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-n", str(ranks), sys.executable, "-m",
               "data_prep", "shards", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return run_group(command, capture_output=True, text=True, timeout=180, cwd=REPO, env=env)


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_mpirun_1_2_4_ranks_give_identical_bytes(small_corpus, chapters_tokenizer, tmp_path):
    outputs = {}
    for ranks in (1, 2, 4):
        out = tmp_path / f"mpi{ranks}"
        done = _mpirun(ranks, "--input", str(small_corpus), "--tokenizer", str(chapters_tokenizer.directory),
                       "--output", str(out), "--seq-len", str(SEQ_LEN), "--shard-size", "300",
                       "--val-fraction", "0.1", "--packing", "stream", "--quiet")  # ShardOptions' default
        assert done.returncode == 0, done.stderr
        assert f"({ranks} rank(s) x 1 worker(s)" in done.stdout
        outputs[ranks] = _files(out)
    local = tmp_path / "local"
    prepare_shards(small_corpus, chapters_tokenizer.directory, local,
                   ShardOptions(seq_len=SEQ_LEN, shard_size=300, val_fraction=0.1, progress=False))
    assert len(outputs[1]) > 5 and "manifest.json" in outputs[1]
    assert outputs[1] == outputs[2] == outputs[4] == _files(local)


def test_mpirun_error_is_reported_not_hung(tmp_path, chapters_tokenizer):
    (tmp_path / "empty").mkdir()
    done = _mpirun(2, "--input", str(tmp_path / "empty"), "--tokenizer", str(chapters_tokenizer.directory),
                   "--output", str(tmp_path / "out"), "--seq-len", "16", "--quiet")
    assert done.returncode != 0
    assert "holds no file" in done.stderr and "What to do" in done.stderr
