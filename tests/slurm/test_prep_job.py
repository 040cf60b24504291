"""`python -m slurm prep`: the rendered array and finalize scripts (arguments quoted, --task and --workers set per
task, the shards arguments checked by data_prep's parser), and on the local cluster a 3-task array plus its
finalize job writing the bytes of a local one-process prep."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from data_prep.cli import main as data_prep_main
from tests.slurm.jobs import job_state, slurm_cli, wait_gone

CORPUS = Path(__file__).resolve().parents[2] / "data" / "sample_corpus"


def _shards_args(tok: Path, out: Path) -> list[str]:
    return ["--input", str(CORPUS), "--tokenizer", str(tok), "--output", str(out), "--seq-len", "64",
            "--engine", "units", "--unit-mb", "1.0", "--val-fraction", "0.1"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prep_tok") / "tok"
    assert data_prep_main(["tokenizer", "--input", str(CORPUS), "--output", str(path), "--vocab-size", "512",
                           "--quiet"]) == 0
    return path


def test_rendered_scripts(tmp_path):
    out = tmp_path / "out $(touch x)"
    done = slurm_cli("prep", "--tasks", "4", "--cpus-per-task", "8", "--partition", "cpu", "--time", "02:00:00",
                     "--array-parallel", "2", "--dry-run", "--", *_shards_args(tmp_path / "tok", out))
    assert done.returncode == 0, done.stderr
    array, final = done.stdout.split("#!/bin/bash")[1:]
    assert "#SBATCH --array=0-3%2" in array and "#SBATCH --cpus-per-task=8" in array
    assert '--task "$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT" --workers "$SLURM_CPUS_PER_TASK"' in array
    assert "'" + str(out) + "'" in array and "-m data_prep finalize --output '" + str(out) + "'" in final
    assert "#SBATCH --array" not in final and not (tmp_path / "x").exists()
    refused = slurm_cli("prep", "--tasks", "2", "--cpus-per-task", "1", "--partition", "cpu", "--time", "10",
                        "--dry-run", "--", *_shards_args(tmp_path / "tok", out), "--task", "0/2")
    assert refused.returncode == 2 and "--task" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1


@pytest.mark.slurm
def test_prep_array_and_finalize_on_the_cluster(cluster, tok, tmp_path):
    assert data_prep_main(["shards", *_shards_args(tok, tmp_path / "local"), "--workers", "1", "--quiet"]) == 0
    out = tmp_path / "array"
    done = slurm_cli("prep", "--tasks", "3", "--cpus-per-task", "1", "--partition", "debug", "--time", "10",
                     "--python", sys.executable, "--", *_shards_args(tok, out))
    assert done.returncode == 0, done.stderr
    array_id, final_id = done.stdout.split()
    wait_gone(array_id, 300)
    wait_gone(final_id, 120)
    logs = "\n".join(p.read_text() for p in sorted((tmp_path / "array.slurm").glob("*.out")))
    assert job_state(final_id).get("JobState", "COMPLETED") == "COMPLETED", logs
    assert (out / "manifest.json").exists(), logs
    files = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "local") for p in (tmp_path / "local").rglob("*") if p.is_file())
    for f in files:
        assert (out / f).read_bytes() == (tmp_path / "local" / f).read_bytes(), f
    assert logs.count("task ") >= 3  # each array task reported its units
    shutil.rmtree(out)
