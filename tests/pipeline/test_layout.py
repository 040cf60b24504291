"""The parallel layout: rank order (tp fastest, then dp, then pp), launch environments, and validation that fails
before any process group exists, with a message listing the sizes that would work."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from pipeline.layout import (BatchDims, LayoutError, ModelDims, group_ranks, init_layout, rank_coords,
                             read_launch_env, validate_layout)

TINY = ModelDims(n_heads=4, kv_heads=4, vocab_size=4096, seq_len=128)


def test_rank_order_is_tp_fastest_then_dp_then_pp():
    assert [rank_coords(r, tp=2, dp=3) for r in range(12)][:7] == [
        (0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 2, 0), (1, 2, 0), (0, 0, 1)]
    groups = group_ranks(tp=2, dp=2, pp=2)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert group_ranks(tp=2, dp=1, pp=3)["embed"] == [[0, 4], [1, 5]]  # first and last stage of each pp group
    assert group_ranks(tp=2, dp=1, pp=1)["embed"] == [[0], [1]]


def test_launch_env_torchrun_slurm_single():
    tr = read_launch_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n0",
                          "MASTER_PORT": "1234"})
    assert (tr.rank, tr.world_size, tr.local_rank, tr.master_addr, tr.master_port, tr.launcher) == (
        3, 8, 1, "n0", 1234, "torchrun")
    sl = read_launch_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "2"})
    assert (sl.rank, sl.world_size, sl.local_rank, sl.launcher) == (5, 6, 2, "slurm")
    assert read_launch_env({}).world_size == 1


def test_dp_is_derived_and_checked():
    assert validate_layout(8, tp=2, pp=2) == (2, 2, 2)
    assert validate_layout(8, tp=2, model=TINY, batch=BatchDims(16, 2)) == (2, 1, 4)
    with pytest.raises(LayoutError, match="tp x pp x dp = 2 x 1 x 3"):
        validate_layout(8, tp=2, dp=3)


@pytest.mark.parametrize("kwargs,message", [
    (dict(world_size=6, tp=4), r"not a multiple of tp x pp = 4 x 1.*valid tp for pp=1: \[1, 2, 3, 6\]"),
    (dict(world_size=6, tp=3, model=TINY), r"does not divide the model's n_heads \(4\).*work.*: \[1, 2\]"),
    (dict(world_size=4, tp=4, model=ModelDims(8, 2, 4096)), r"kv heads \(2\).*: \[1, 2\]"),
    (dict(world_size=4, tp=4, model=ModelDims(8, 8, 4098)), r"padded vocabulary \(4098\).*: \[1, 2\]"),
    (dict(world_size=8, tp=1, batch=BatchDims(global_batch=16, micro_batch=4)),
     r"dp=8 .* 2 rows .* dp values that work: \[1, 2, 4\]"),
    (dict(world_size=4, tp=4, model=ModelDims(4, 4, 4096, seq_len=66)), r"seq_len=66 .* tp \[1, 2\]"),
])
def test_invalid_layouts_list_working_sizes(kwargs, message):
    with pytest.raises(LayoutError, match=message):
        validate_layout(**kwargs)


def test_invalid_layout_fails_before_any_process_group(monkeypatch):
    """A 4-process torchrun environment with a bad tp: init_layout raises before init_process_group (which would
    block waiting for the other 3 ranks)."""
    env = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    with pytest.raises(LayoutError, match=r"n_heads \(6\).*\[1, 2\]"):
        init_layout(tp=4, model=ModelDims(6, 6, 32768), environ=env)
    with pytest.raises(LayoutError, match="dp values that work"):
        init_layout(tp=1, batch=BatchDims(6, 3), environ=env)
    assert not dist.is_initialized()


def test_single_process_layout_has_no_process_group():
    layout = init_layout(tp=1, model=TINY, environ={})
    assert layout.world_size == 1 and layout.tp_group is None and layout.dp_group is None
    assert not dist.is_initialized()
    assert (layout.tp_rank, layout.dp_rank, layout.pp_rank) == (0, 0, 0)
