"""Interrupted and re-run, the runner skips the finished point (its files untouched) and resumes the running one from
its checkpoint (its next step is the checkpoint's, not 0); a point whose config changed is refused by name."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import json, sys
from pathlib import Path
from megaloop.repro.runner import Runner, Stopped, plan_point
from megaloop.repro.sizes import base_overrides, make_scale
from megaloop.repro.study import Point

work, shards = Path(sys.argv[1]), Path(sys.argv[2])
scale = make_scale("smoke", work, work, 1)
points = [Point("t", name, "configs/parcae-tiny.yaml", overrides=(*base_overrides(scale), f"train.steps={n}",
                "checkpoint.every=2", "train.val_every=1000", "data.val_batches=1", "train.val_depths=[1]",
                "train.precision=fp32"))
          for name, n in (("a", 4), ("b", 24))]
plans = [plan_point(p, scale, shards) for p in points]
print(json.dumps({p.point.name: p.state for p in plans}), flush=True)
try:
    Runner(scale, shards, jobs=1, progress=False).run(plans)
except Stopped:
    sys.exit(75)
"""


def train_steps(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def start(script: Path, work: Path, shards: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(script), str(work), str(shards)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_interrupted_study_skips_finished_and_resumes_running(tmp_path, tiny_shards):
    script = tmp_path / "run_points.py"
    script.write_text(SCRIPT)
    work = tmp_path / "work"
    a, b = work / "runs" / "t" / "a", work / "runs" / "t" / "b"
    proc = start(script, work, tiny_shards)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # b is training and has committed a checkpoint: stop the study
        ckpts = list((b / "checkpoints").glob("step_*/COMMIT")) if b.exists() else []
        if ckpts and proc.poll() is None:
            break
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-2000:]
    assert (a / "done.json").is_file() and not (b / "done.json").exists()
    assert (b / "STOPPED").is_file()  # the trainer saved on the forwarded SIGTERM
    saved = max(int(p.parent.name.split("_")[1]) for p in (b / "checkpoints").glob("step_*/COMMIT"))
    assert 0 < saved < 24
    first_job = [r for r in train_steps(b / "metrics.jsonl") if r["kind"] == "train"]
    first_step = first_job[0]["step"]
    stamps = {f: (a / f).stat().st_mtime_ns for f in ("metrics.jsonl", "done.json", "repro.log", "point.json")}

    again = start(script, work, tiny_shards)
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err[-2000:]
    assert json.loads(out.splitlines()[0]) == {"a": "done", "b": "resume"}
    assert {f: (a / f).stat().st_mtime_ns for f in stamps} == stamps  # a was not touched, let alone retrained
    records = train_steps(b / "metrics.jsonl")
    resume = [i for i, r in enumerate(records) if r["kind"] == "resume"]
    assert len(resume) == 1 and records[resume[0]]["step"] == saved
    after = [r["step"] for r in records[resume[0]:] if r["kind"] == "train"]
    assert after[0] == saved + first_step and after[-1] == first_job[0]["step"] + 23  # continued, then finished
    assert json.loads((b / "done.json").read_text())["outcome"] == "completed"


def test_changed_config_is_refused_by_name(tmp_path, tiny_shards):
    from megaloop.config import ConfigError
    from megaloop.repro.runner import config_hash, plan_point, run_dir
    from megaloop.repro.sizes import make_scale
    from megaloop.repro.study import Point

    scale = make_scale("smoke", tmp_path, tmp_path, 1)
    p = Point("t", "a", "configs/parcae-tiny.yaml", overrides=("train.steps=4",))
    d = run_dir(scale, p)
    d.mkdir(parents=True)
    (d / "point.json").write_text(json.dumps({"config_hash": config_hash(p, scale, tiny_shards)}))
    assert plan_point(p, scale, tiny_shards).state == "restart"
    changed = Point("t", "a", "configs/parcae-tiny.yaml", overrides=("train.steps=5",))
    with pytest.raises(ConfigError, match="point t/a.*delete"):
        plan_point(changed, scale, tiny_shards)
    # the paths differ between work folders; they are not part of the hash
    assert config_hash(p, scale, tiny_shards) == config_hash(p, make_scale("smoke", tmp_path, tmp_path / "x", 1),
                                                             tiny_shards)
