"""The validation set is a fixed set of rows whatever the layout: a dp2 run validates on the rows a dp1 run does,
its closing table and metrics say how many rows and tokens, and `megaloop eval` with its defaults reproduces the
trainer's last validation."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megaloop.__main__ import main
from tests.train.conftest import TINY, fast_overrides

REPO = Path(__file__).resolve().parents[2]
STEPS = 2


def val_records(out: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["T"]: r for r in records if r["kind"] == "val" and r["step"] == STEPS}


def run(shards, out: Path, nproc: int) -> str:
    sets = fast_overrides(shards, out, STEPS) + ["train.val_depths=[2]", "data.val_batches=3",
                                                 "train.precision=fp32"]
    cmd = [sys.executable, "-m", "megaloop", "launch", "--nproc-per-node", str(nproc), str(TINY)]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    done = subprocess.run(cmd + [a for s in sets for a in ("--set", s)], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.multiproc
def test_dp1_and_dp2_validate_on_the_same_rows_and_eval_reproduces_it(tiny_shards, tmp_path, capsys):
    one, two = tmp_path / "dp1", tmp_path / "dp2"
    table = run(tiny_shards, one, 1)
    run(tiny_shards, two, 2)
    micro = 4  # fast_overrides' data.micro_batch_size: 3 x 4 rows whatever dp (dp2 once read 3 x 4 x 2)
    a, b = val_records(one), val_records(two)
    assert a[2]["rows"] == b[2]["rows"] == 3 * micro and a[2]["tokens"] == b[2]["tokens"]
    assert f"(validation: {3 * micro} rows, {a[2]['tokens']:,} tokens)" in table
    assert main(["eval", str(one), "--depths", "2", "--json"]) == 0
    ours = json.loads(capsys.readouterr().out)
    assert ours["val_rows"] == 3 * micro and ours["precision"] == "fp32"
    assert ours["depths"]["2"]["tokens"] == a[2]["tokens"]
    assert abs(ours["depths"]["2"]["loss"] - a[2]["val_loss"]) < 1e-5, (ours["depths"]["2"], a[2])
