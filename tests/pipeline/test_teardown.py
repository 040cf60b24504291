"""A multi-process job ends with no process-group thread left: a gloo group runs collectives on C++ worker threads
that live as long as the group, and one of them dropping the last reference to a tensor while the interpreter
finalizes aborts the process (SIGABRT, "terminate called without an active exception" after a successful run)."""
from __future__ import annotations

import pytest
import torch

from tests.pipeline.spawn import spawn
from tests.pipeline.test_layout_equivalence import TINY, overrides
from tests.pipeline.workers_train import teardown_worker


@pytest.mark.multiproc
def test_train_frees_every_group_thread(tiny_shards, tmp_path):
    sets = overrides(tiny_shards, tmp_path / "run", "parcae", "fp32", tp=2) + [
        "train.steps=2", "checkpoint.every=1", "checkpoint.async_save=true"]
    spawn(teardown_worker, 4, str(TINY), sets, str(tmp_path / "threads"))
    counts = [torch.load(f"{tmp_path / 'threads'}.{rank}") for rank in range(4)]
    print("gloo threads per rank during / after the tp2 x dp2 job:",
          ", ".join(f"{c['during']} / {c['after']}" for c in counts))
    assert all(c["during"] > 0 for c in counts), counts  # the count sees them
    assert all(c["after"] == 0 for c in counts), counts
