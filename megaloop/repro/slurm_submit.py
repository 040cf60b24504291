"""--slurm: each training point not yet trained becomes one `python -m slurm submit` job whose run folder is the
point's (--out-root WORK/runs/<study> --job-name <name>); points whose job finished (COMPLETED in the run folder)
are evaluated here, and the speed points run here once every training point is done. A point is submitted once
(slurm.json records its job); delete that file to submit it again (a job that was cancelled)."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

from megaloop.config import ConfigError
from megaloop.repro.runner import REPO, Plan, PointFailed, Runner, git_commit, overrides
from megaloop.repro.study import Scale


def submit(plans: list[Plan], scale: Scale, shards: Path, slurm_args: str, jobs: int, progress: bool) -> int:
    """Submit what must train, evaluate what Slurm finished; returns the number of points still in Slurm's hands."""
    extra = shlex.split(slurm_args)
    todo = [p for p in plans if p.state != "done"]
    train = [p for p in todo if p.point.kind == "train"]
    finished = [p for p in train if (p.dir / "COMPLETED").is_file()]
    pending = 0
    for plan in train:
        if plan in finished:
            continue
        pending += 1
        if not (plan.dir / "slurm.json").is_file():  # submitted once: the job requeues itself on a stop (slurm/)
            _submit_one(plan, scale, shards, extra)
    local = finished + ([p for p in todo if p.point.kind != "train"] if not pending else [])
    Runner(scale, shards, jobs, progress).run(local)  # a COMPLETED run trains no step: only its evaluation runs
    return pending


def _submit_one(plan: Plan, scale: Scale, shards: Path, extra: list[str]) -> None:
    p = plan.point
    sets = [s for s in overrides(p, scale, shards) if not s.startswith("train.out_dir=")]
    cmd = [sys.executable, "-m", "slurm", "submit", str(REPO / p.config), "--nodes", "1", "--procs-per-node",
           str(p.nproc), "--job-name", p.name, "--out-root", str(plan.dir.parent), *extra,
           *(a for s in sets for a in ("--set", s))]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode == 2:
        raise ConfigError("--slurm", " ".join(extra), (done.stderr.strip().splitlines() or ["refused"])[-1])
    if done.returncode:
        raise PointFailed(f"submitting {p.study}/{p.name} failed (exit {done.returncode}): "
                          f"{(done.stderr.strip().splitlines() or [''])[-1]}")
    job = re.findall(r"\d+", done.stdout)
    plan.dir.mkdir(parents=True, exist_ok=True)
    record = {"point": p.name, "config_hash": plan.hash, "job": job[-1] if job else done.stdout.strip(),
              **git_commit()}
    (plan.dir / "point.json").write_text(json.dumps({**record, "submitted": True}, indent=2))
    (plan.dir / "slurm.json").write_text(json.dumps(record, indent=2))
