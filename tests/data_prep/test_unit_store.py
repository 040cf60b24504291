"""Units commit atomically; a re-run reuses exactly the committed units whose key still matches."""
from __future__ import annotations

import pytest

from data_prep.inputs import InputFile
from data_prep.unit_store import (clear_task_tmp, commit_unit, committed, read_unit, task_tmp, unit_dir,
                                  write_plan)
from data_prep.units import plan_units


def _units(fingerprint="f", mtime=1):
    files = [(InputFile(n, n, 10, mtime if n == "c" else 1, "text", None), [10]) for n in "abc"]
    return plan_units(files, unit_bytes=10, fingerprint=fingerprint)


def _write(tmp):
    (tmp / "train-000000-0000.tar").write_bytes(b"rows")
    return {"rows": 1}


def test_commit_then_rerun_skips_only_matching_units(tmp_path):
    units = _units()
    write_plan(tmp_path, units, "f")
    commit_unit(tmp_path, units[0], _write)
    commit_unit(tmp_path, units[2], _write)
    assert committed(tmp_path, units) == {0, 2}
    assert read_unit(tmp_path, 0) == {"rows": 1, "index": 0, "key": units[0].key}
    assert (unit_dir(tmp_path, 0) / "train-000000-0000.tar").read_bytes() == b"rows"
    assert committed(tmp_path, _units(mtime=2)) == {0}  # file c changed: its unit must be redone
    assert committed(tmp_path, _units(fingerprint="g")) == set()  # other options: nothing reusable


def test_a_unit_killed_while_writing_leaves_nothing_committed(tmp_path):
    units = _units()
    write_plan(tmp_path, units, "f")

    def crash(tmp):
        (tmp / "train-000001-0000.tar").write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        commit_unit(tmp_path, units[1], crash)
    assert committed(tmp_path, units) == set()
    assert not any(task_tmp(tmp_path).iterdir())  # an error removes the unit's half-written folder at once
    # a SIGKILL cannot: its leftovers are cleared when that task runs again, and only that task's
    for task in ("0-of-1", "1-of-2"):
        (task_tmp(tmp_path, task) / "000001-x").mkdir(parents=True)
    clear_task_tmp(tmp_path, "0-of-1")
    assert not task_tmp(tmp_path, "0-of-1").exists() and task_tmp(tmp_path, "1-of-2").exists()
