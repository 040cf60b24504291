"""Committed work units under OUT/.prep: written in a temporary directory, made visible by one rename.

Layout: `.prep/plan.json` (the plan of the latest invocation), `.prep/units/{index:06d}/unit.json` (+ the unit's
shards), `.prep/tmp/` (units being written; anything there is left over from a killed run and is removed). A unit
counts as committed only when its directory exists and its unit.json holds the plan's key for that index.
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


def write_plan(out, units: list[WorkUnit], fingerprint: str) -> None:
    """Record the plan (atomically) and clear what a killed run left half-written."""
    root = prep_dir(out)
    shutil.rmtree(root / "tmp", ignore_errors=True)
    (root / "units").mkdir(parents=True, exist_ok=True)
    plan = {"fingerprint": fingerprint, "units": [{"index": u.index, "key": u.key, "size": u.size} for u in units]}
    tmp = root / f"plan.json.{uuid.uuid4().hex}"
    tmp.write_text(json.dumps(plan, indent=1, sort_keys=True))
    os.replace(tmp, root / "plan.json")


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


def commit_unit(out, unit: WorkUnit, write: Callable[[Path], dict]) -> None:
    """Run `write(tmp_dir)` (it writes the unit's files and returns its summary), then commit by renaming.

    A stale directory of the same index (another key) is replaced; a crash leaves only `.prep/tmp` behind.
    """
    tmp = prep_dir(out) / "tmp" / f"{unit.index:06d}-{uuid.uuid4().hex}"
    tmp.mkdir(parents=True)
    summary = dict(write(tmp))
    summary.update(index=unit.index, key=unit.key)
    (tmp / UNIT_FILE).write_text(json.dumps(summary, indent=1, sort_keys=True))
    target = unit_dir(out, unit.index)
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)


def read_unit(out, index: int) -> dict:
    return json.loads((unit_dir(out, index) / UNIT_FILE).read_text())
