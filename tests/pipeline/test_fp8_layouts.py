"""FP8 scales are layout-free: under tensor parallelism (with and without sequence parallelism) every scale of an
FP8 layer equals the single process's bit for bit on the same whole tensors, because the amax of each operand a
layer holds split is reduced over the tp group (pipeline/fp8.py): an MLP's column-parallel fc (plain and SwiGLU's
paired halves) and row-parallel proj, both recipes. Without the reduction (the control) the scales differ.

The trainer under tp2 (sequence parallel) in fp64 with power-of-2 scales: every scale of every FP8 call of a few
steps equals the single process's bit for bit, since a float64 FP8 GEMM is exact (pipeline/fp8.py) and a power-of-2
scale makes the split contraction's sum over ranks the single process's sum. tp2, dp2, pp2 and tp2 x dp2 over 10
steps, both recipes, fp32 and fp64, are `python benchmarks/fp8_layouts.py`."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.fp8 import Float8Linear
from tests.pipeline.spawn import spawn
from tests.pipeline.workers_fp8 import compare_runs, fp8_run, layout_overrides, tp2_worker
from tests.pipeline.workers_train import ReferenceRuntime

OUT_TOL = 1e-6  # fp32 output: the row-parallel partial sums are added in another order
TINY = Path(__file__).resolve().parents[2] / "configs" / "parcae-tiny.yaml"
TRAINER_STEPS = 2
FP64_LOSS_TOL = 1e-14  # ulps: the non-FP8 parts (the vocab-parallel head's dgrad) sum split GEMMs in another order


def run_overrides(shards, root, label: str) -> list[str]:
    """The trainer test's run: tensorwise (e5m2 gradients too) with power-of-2 scales in fp64, 2 steps of 4 rows."""
    return layout_overrides(shards, root / label, "tensorwise", "fp64", TRAINER_STEPS, "pow2") + [
        "data.global_batch_size=4"]


@pytest.fixture(scope="module")
def tp2_world(tmp_path_factory, tiny_shards):
    """One two-process world for both tests: the MLP scales, then the trainer at tp2. Returns (MLP results, the
    trainer run, the folder)."""
    root = tmp_path_factory.mktemp("fp8_tp2")
    mlp_out, runs_out = root / "scales.pt", root / "runs.pt"
    spawn(tp2_worker, 2, str(mlp_out), str(TINY), {"tp2": run_overrides(tiny_shards, root, "tp2") + ["parallel.tp=2"]},
          str(runs_out))
    return torch.load(mlp_out), torch.load(runs_out)["tp2"], root


@pytest.mark.multiproc
def test_tp2_scales_equal_single_process(tp2_world):
    results = tp2_world[0]
    assert len(results) == 2 * 2 * 3
    for (mlp, recipe, sp, reduce), got in results.items():
        print(f"{mlp} {recipe} sp={sp} amax reduced={reduce}: {len(got['equal'])} / {got['n']} scales "
              f"bit-identical, output rel err {got['y_err']:.1e}")
        assert got["n"] == 2 * 3  # fc and proj: x, w, g
        if reduce:
            assert len(got["equal"]) == got["n"] and got["y_err"] <= OUT_TOL
        else:  # rank-local amaxes: the split operands' scales are this rank's, not the tensor's
            assert len(got["equal"]) <= got["n"] - 2


@pytest.mark.multiproc
def test_tp2_trainer_every_scale_bit_identical_in_fp64(tp2_world, tiny_shards, monkeypatch):
    monkeypatch.setattr(Float8Linear, "record_every_call", False)  # fp8_run turns it on: restored afterwards
    _, tp2, root = tp2_world
    ref = fp8_run(str(TINY), run_overrides(tiny_shards, root, "one"), lambda cfg, device: ReferenceRuntime(device))
    got = compare_runs(tp2, ref)
    print(f"tp2 tensorwise fp64 pow2, {TRAINER_STEPS} steps: every call {got['calls_equal']} / {got['calls']} scales "
          f"bit-identical, first calls {got['scales_equal']} / {got['scales']}, loss rel err {got['loss_rel']:.1e}")
    assert got["calls"] > 100 and not got["missing"]
    assert got["calls_equal"] == got["calls"] and got["scales_equal"] == got["scales"]
    assert got["loss_rel"] <= FP64_LOSS_TOL
