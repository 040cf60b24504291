"""FP8 runs through megaloop's trainer and its checkpoints: a run stopped and re-run equals the straight run bit
for bit (fp32 master weights, same threads), and since the parameters stay plain weights, an FP8 checkpoint
resumes with FP8 off and continues."""
from __future__ import annotations

import math

import pytest
import torch

from megaloop.config import load_config
from megaloop.train.loop import train
from megaloop.train.metrics import read_metrics
from megaloop.train.runtime import SingleProcessRuntime
from pipeline.fp8 import Float8Linear
from tests.train.conftest import TINY, fast_overrides


class KeepingRuntime(SingleProcessRuntime):
    def prepare_model(self, model, materialize=None):
        self.model = super().prepare_model(model, materialize)
        return self.model


def run(shards, out_dir, steps: int, *extra: str):
    runtime = KeepingRuntime(torch.device("cpu"))
    cfg = load_config(str(TINY), fast_overrides(shards, out_dir, steps) + ["train.val_every=1000", *extra])
    summary = train(cfg, runtime=runtime)
    fp8_layers = sum(isinstance(m, Float8Linear) for m in runtime.model.modules())
    return summary, {n: p.detach().clone() for n, p in runtime.model.named_parameters()}, fp8_layers


@pytest.fixture(scope="module")
def straight(tiny_shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8-straight")
    return (out, *run(tiny_shards, out, 4, "train.fp8=tensorwise"))


def test_fp8_stop_and_rerun_equals_straight_run_bitwise(straight, tiny_shards, tmp_path):
    _, summary, params, layers = straight
    assert layers == 2 * 6  # the core's two blocks (prelude and coda stay in high precision by default)
    first, _, _ = run(tiny_shards, tmp_path, 4, "train.fp8=tensorwise", "train.stop_at_step=2")
    second, params_b, _ = run(tiny_shards, tmp_path, 4, "train.fp8=tensorwise")
    print(f"fp8 straight {summary.losses}; 2 + 2 {first.losses + second.losses}")
    assert second.start_step == 2 and first.losses + second.losses == summary.losses
    assert all(torch.equal(params_b[n], p) for n, p in params.items())


def test_fp8_checkpoint_continues_with_fp8_off(straight, tiny_shards):
    out, before, params, _ = straight
    after, params_after, layers = run(tiny_shards, out, 5, "train.fp8=none")
    print(f"fp8 tensorwise -> none: losses {before.losses[-1]:.4f} -> {after.losses}")
    assert after.start_step == 4 and after.steps_done == 5 and layers == 0
    assert all(math.isfinite(x) for x in after.losses) and abs(after.losses[0] - before.losses[-1]) < 0.5
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "resume"][-1] == 4
    assert set(params_after) == set(params)
