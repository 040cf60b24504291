"""The planner's checkpoint cost (megaloop.plan.checkpoint_cost): its checkpoint size equals the bytes of the
arrays a real run saves, and the interval, overhead and loss per failure follow the cadence rule by hand."""
import math

import pytest

from checkpoints.load import CheckpointReader, find_checkpoints
from megaloop.config import load_config
from megaloop.plan.checkpoint_cost import AGREE_S, D2H_GBPS, checkpoint_bytes, checkpoint_cost
from megaloop.plan.gpus import gpu
from megaloop.plan.layout import local_params
from megaloop.plan.planner import make_plan
from megaloop.train.cadence import AUTO_MIN_MINUTES
from megaloop.train.cli import run_training
from tests.train.conftest import TINY, fast_overrides


def test_checkpoint_bytes_equal_what_a_run_saves(tiny_shards, tmp_path):
    overrides = fast_overrides(tiny_shards, tmp_path, steps=2) + ["train.val_every=1000"]
    cfg = load_config(TINY, overrides)
    assert run_training(cfg) == 0
    reader = CheckpointReader(find_checkpoints(tmp_path / "checkpoints")[0])
    saved = sum(info.nbytes for info in reader.arrays.values())
    assert checkpoint_bytes(local_params(cfg, 1), cfg.train.precision) == saved


@pytest.mark.parametrize("every_minutes, every, expected_s", [("auto", 0, AUTO_MIN_MINUTES * 60), (3, 0, 180.0),
                                                             (30, 100, 100 * 0.5), (0, 0, None)])
def test_interval_overhead_and_loss_per_failure_by_hand(every_minutes, every, expected_s):
    cfg = load_config("configs/parcae-1_3b.yaml", [f"checkpoint.every_minutes={every_minutes}",
                                                   f"checkpoint.every={every}"], world_size=128)
    plan = make_plan(cfg, gpu("h100"), 128)
    cost = checkpoint_cost(plan, step_time_s=0.5, storage_gbps=10.0)
    total = checkpoint_bytes(plan.params, "bf16")
    assert cost.total_bytes == total and cost.rank_bytes == math.ceil(total / 128)
    assert cost.stall_s == pytest.approx(cost.rank_bytes / (D2H_GBPS * 1e9) + AGREE_S, rel=1e-12)
    assert cost.write_s == pytest.approx(total / 10e9, rel=1e-12)
    assert cost.interval_s == expected_s
    if expected_s is None:
        assert cost.mean_loss_s is None and cost.overhead == 0
    else:
        assert cost.mean_loss_s == expected_s / 2 and cost.overhead == pytest.approx(cost.stall_s / expected_s)
