"""Rank 0's commit waits on the file system gently: one listing of the staging directory per poll (not a file
open per rank), and polls that slow down to one a second."""
from __future__ import annotations

import os

from checkpoints import commit, files


def test_commit_lists_once_per_poll_and_slows_to_one_poll_a_second(tmp_path, monkeypatch):
    stage, world = tmp_path / "step_00000001.tmp-ab", 3
    stage.mkdir()
    sleeps, listings, scandir = [], [], os.scandir

    def sleep(seconds):
        sleeps.append(seconds)
        if len(sleeps) == 20:  # the ranks' parts appear only now, long after the first polls
            for r in range(world):
                files.atomic_write_json(stage / files.manifest_part_name(r),
                                        {"token": "ab", "files": {}, "algorithm": files.HASH_ALGORITHM})

    monkeypatch.setattr(files.time, "sleep", sleep)
    monkeypatch.setattr(commit.os, "scandir", lambda path: listings.append(path) or scandir(path))
    parts = commit._wait_for_parts(stage, "ab", world, timeout_s=1e9)
    assert [p["token"] for p in parts] == ["ab"] * world
    assert len(listings) == len(sleeps) + 1          # one listing per poll, whatever the number of ranks
    assert max(sleeps) == files.POLL_MAX_S == 1.0 and sleeps[-5:] == [1.0] * 5
    assert sum(s < 1.0 for s in sleeps) <= 10          # the quick polls last about one second in all
