"""--slurm: a training point becomes one `python -m slurm submit` job whose run folder is the point's, submitted once
(a fake sbatch on PATH records the calls)."""
from __future__ import annotations

import json
import os
from pathlib import Path


def test_point_is_submitted_once_into_its_run_dir(tmp_path, tiny_shards, monkeypatch):
    from megaloop.repro.runner import plan_point
    from megaloop.repro.sizes import make_scale
    from megaloop.repro.slurm_submit import submit
    from megaloop.repro.study import Point

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\necho 4242\n")
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    scale = make_scale("smoke", tmp_path, tmp_path / "work", 1)
    plan = plan_point(Point("t", "a", "configs/parcae-tiny.yaml", overrides=("train.steps=4",)), scale, tiny_shards)
    args = "--partition cpu --time 10 --no-check"
    assert submit([plan], scale, tiny_shards, args, 1, False) == 1  # one point in Slurm's hands
    record = json.loads((plan.dir / "slurm.json").read_text())
    assert record["job"] == "4242" and record["config_hash"] == plan.hash
    scripts = list((plan.dir / "slurm").glob("*.sbatch"))
    assert len(scripts) == 1
    text = scripts[0].read_text()
    assert str(plan.dir) in text and f"data.shards={tiny_shards}" in text and "model.vocab_size=512" in text
    assert submit([plan_point(plan.point, scale, tiny_shards)], scale, tiny_shards, args, 1, False) == 1
    assert len(Path(calls).read_text().splitlines()) == 1, "a submitted point is not submitted again"
