"""Committed work units under OUT/.prep: written in a temporary directory, made visible by one rename.

Layout: `.prep/plan.json` (the plan of the latest invocation), `.prep/units/{index:06d}/unit.json` (+ the unit's
shards), `.prep/tmp/task-I-of-N/` (units that task is writing; what a killed run left there is removed when the
task runs again). A unit counts as committed only when its directory exists and its unit.json holds the plan's key
for that index.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Callable

from .units import WorkUnit

PREP_DIR = ".prep"
UNIT_FILE = "unit.json"


def prep_dir(out) -> Path:
    return Path(out) / PREP_DIR


def unit_dir(out, index: int) -> Path:
    return prep_dir(out) / "units" / f"{index:06d}"


def write_plan(out, units: list[WorkUnit], fingerprint: str, job: dict | None = None) -> None:
    """Record the plan (atomically) and clear what a killed run left half-written. `job`: what `data_prep
    finalize` needs besides the units (the recorded options, the tokenizer, the inputs)."""
    root = prep_dir(out)
    (root / "units").mkdir(parents=True, exist_ok=True)
    plan = {"fingerprint": fingerprint, "units": [{"index": u.index, "key": u.key, "size": u.size} for u in units],
            "job": job or {}}
    tmp = root / f"plan.json.{uuid.uuid4().hex}"
    tmp.write_text(json.dumps(plan, indent=1, sort_keys=True))
    os.replace(tmp, root / "plan.json")


def task_tmp(out, task: str = "0-of-1") -> Path:
    """A task's own folder for units being written (tasks running at once never touch each other's)."""
    return prep_dir(out) / "tmp" / f"task-{task}"


def clear_task_tmp(out, task: str = "0-of-1") -> None:
    """Remove what a killed run of this task left half-written."""
    shutil.rmtree(task_tmp(out, task), ignore_errors=True)


def committed(out, units: list[WorkUnit]) -> set[int]:
    """Indices of the units whose committed unit.json holds their current key."""
    done = set()
    for unit in units:
        path = unit_dir(out, unit.index) / UNIT_FILE
        try:
            if json.loads(path.read_text()).get("key") == unit.key:
                done.add(unit.index)
        except (OSError, ValueError):
            continue
    return done


def commit_unit(out, unit: WorkUnit, write: Callable[[Path], dict], task: str = "0-of-1") -> None:
    """Run `write(tmp_dir)` (it writes the unit's files and returns its summary), then commit by renaming.

    A stale directory of the same index (another key) is replaced; a crash leaves only `.prep/tmp` behind.
    """
    tmp = task_tmp(out, task) / f"{unit.index:06d}-{uuid.uuid4().hex}"
    tmp.mkdir(parents=True)
    try:
        summary = dict(write(tmp))
        summary.update(index=unit.index, key=unit.key)
        (tmp / UNIT_FILE).write_text(json.dumps(summary, indent=1, sort_keys=True))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing half-written stays behind
        raise
    target = unit_dir(out, unit.index)
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)


def read_plan(out) -> dict:
    return json.loads((prep_dir(out) / "plan.json").read_text())


def read_unit(out, index: int) -> dict:
    return json.loads((unit_dir(out, index) / UNIT_FILE).read_text())
