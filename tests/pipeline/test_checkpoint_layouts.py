"""Checkpoints across layouts, through megaloop's trainer on gloo (parcae-tiny, 32-token rows, per-sequence depths,
gradient accumulation, Muon + AdamW with the distributed Muon and ZeRO-1 AdamW):

- bitwise resume under tp2 x dp2 (fp32): a run stopped at step 8 and re-run to 16 gives the 16-step run's
  per-step losses and final parameters exactly (a resume that lost or changed any state, the optimizers' moments,
  the data position or the step count, changes the losses from the first step after it);
- resharding: a checkpoint saved under tp2 x dp2 loads in one process, under dp3 and under tp4 with every parameter
  and optimizer state equal to the saved global arrays bit for bit (each rank compares what it holds), and continuing
  in each layout matches continuing in the saving layout within 1e-12 (train.precision=fp64)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.pipeline.models import max_rel_err
from tests.pipeline.spawn import spawn
from tests.pipeline.workers_ckpt import resume_worker, worker

TINY = Path(__file__).resolve().parents[2] / "configs" / "parcae-tiny.yaml"
FP64_TOL = 1e-12


def overrides(shards, out_dir, steps: int, precision: str, tp: int, *extra: str) -> list[str]:
    """12 rows per step in micro-batches of 2 (6, 3 and 2 micro-batches per rank at dp 1, 2 and 3)."""
    return [f"data.shards={shards}", f"train.out_dir={out_dir}", f"train.steps={steps}", "model.vocab_size=512",
            "model.seq_len=32", "data.micro_batch_size=2", "data.global_batch_size=12", "data.val_batches=1",
            "train.val_every=1000", "train.progress=false", f"train.precision={precision}", "train.val_depths=[2]",
            f"parallel.tp={tp}", *extra]


@pytest.mark.multiproc
def test_tp2_dp2_stop_and_rerun_equals_straight_run_bitwise(tiny_shards, tmp_path):
    jobs = [("straight", overrides(tiny_shards, tmp_path / "a", 16, "fp32", 2)),
            ("first", overrides(tiny_shards, tmp_path / "b", 16, "fp32", 2, "train.stop_at_step=8")),
            ("second", overrides(tiny_shards, tmp_path / "b", 16, "fp32", 2))]
    spawn(worker, 4, str(TINY), jobs, str(tmp_path / "out.pt"))
    r = torch.load(tmp_path / "out.pt")
    a, first, second = r["straight"], r["first"], r["second"]
    assert first["interrupted"] and first["done"] == 8 and second["start"] == 8 and second["done"] == 16
    losses = first["losses"] + second["losses"]
    same = all(torch.equal(second["params"][n], p) for n, p in a["params"].items())
    print(f"tp2 x dp2: 16 straight {a['losses'][0]:.6f} .. {a['losses'][-1]:.6f}; 8 + 8 identical losses "
          f"{losses == a['losses']}, identical parameters {same}")
    assert losses == a["losses"]
    assert same


@pytest.fixture(scope="module")
def saved_tp2_dp2(tiny_shards, tmp_path_factory):
    """fp64: 10 steps under tp2 x dp2 stopping at step 5 (the checkpoint), then continued in that layout."""
    out = tmp_path_factory.mktemp("saved")
    jobs = [("first", overrides(tiny_shards, out / "run", 10, "fp64", 2, "train.stop_at_step=5")),
            ("rest", overrides(tiny_shards, out / "run", 10, "fp64", 2))]
    spawn(worker, 4, str(TINY), jobs, str(out / "out.pt"))
    results = torch.load(out / "out.pt")
    assert results["rest"]["start"] == 5
    step_dir = out / "run" / "checkpoints" / "step_00000005"
    assert (step_dir / "COMMIT").is_file()
    return step_dir, results["rest"]


LAYOUTS = {"one process": (1, 1), "dp3": (3, 1), "tp4": (4, 4)}


@pytest.mark.multiproc
@pytest.mark.parametrize("label", list(LAYOUTS))
def test_reshard_tp2_dp2_checkpoint(label, saved_tp2_dp2, tiny_shards, tmp_path):
    step_dir, reference = saved_tp2_dp2
    world, tp = LAYOUTS[label]
    resume = [f"checkpoint.resume={step_dir}"]
    # one world: restore and compare, then continue (as a fresh job) from the same checkpoint
    checks = [("loaded", overrides(tiny_shards, tmp_path / "check", 10, "fp64", tp, *resume))]
    jobs = [("continued", overrides(tiny_shards, tmp_path / "run", 10, "fp64", tp, *resume))]
    spawn(resume_worker, world, str(TINY), checks, jobs, str(tmp_path / "out.pt"))
    results = torch.load(tmp_path / "out.pt")
    state = results["loaded"]
    covered = set().union(*map(set, state["names"]))
    print(f"{label}: loaded step {state['start']}, {sum(state['pieces'])} pieces on {world} rank(s) compared with "
          f"the saved arrays, {sum(map(len, state['mismatched']))} differ; {len(covered)} of {len(state['arrays'])} "
          "arrays held")
    assert state["start"] == 5
    assert not any(state["mismatched"]), state["mismatched"]
    assert covered == set(state["arrays"])

    got = results["continued"]
    assert got["start"] == 5 and len(got["losses"]) == len(reference["losses"]) == 5
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], reference["losses"]))
    param_err = max(max_rel_err(got["params"][n], p) for n, p in reference["params"].items())
    print(f"{label}: steps 5..9 continued, worst loss rel err {loss_err:.1e}, worst param err {param_err:.1e} "
          "against continuing under tp2 x dp2")
    assert loss_err <= FP64_TOL and param_err <= FP64_TOL
