"""Checkpoints under pipeline parallelism, through megaloop's trainer on gloo (parcae-tiny with 4 core blocks, 32-token
rows, per-sequence depths, gradient accumulation, Muon + AdamW; distributed Muon and ZeRO-1 AdamW under dp):

- a checkpoint saved under pp2 x dp2 (fp64, step 3) loads in one process and under tp2 with every parameter and
  optimizer state, gathered over the ranks, equal to what the pp2 x dp2 run held (torch.equal), and continuing there
  for 3 steps matches continuing under pp2 x dp2 within 1e-12: not bit for bit, because the data-parallel gradient
  sum and the tied embedding's sum of its two stages' gradients run in another order than one process's (or tp2's)
  accumulation;
- bitwise resume under pp2 (fp32, one thread per rank): 8 steps straight equal 4 + stop + 4 (losses, parameters);
- the reverse: a one-process checkpoint loads under pp2 bit for bit and continues within 1e-12 of one process.

One world of 4 and one of 2 run every multi-process job; the one-process jobs run in the test process."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megaloop.optim.combined import build_optimizer, check_saved_names, join_names, merge_scalars, parameter_names
from megaloop.optim.config import OptimConfig
from tests.pipeline.models import max_rel_err
from tests.pipeline.spawn import spawn
from tests.pipeline.test_checkpoint_layouts import FP64_TOL, TINY
from tests.pipeline.test_checkpoint_layouts import overrides as layout_overrides
from tests.pipeline.workers_ckpt import loaded_state, resume_worker, run, worker

SAVE, STEPS = 3, 6
FP32_HALF = 4


def overrides(shards, out_dir, steps: int, precision: str, tp: int = 1, pp: int = 1, *extra: str) -> list[str]:
    """test_checkpoint_layouts' runs (12 rows per step in micro-batches of 2) with 4 core blocks and `pp` stages."""
    return layout_overrides(shards, out_dir, steps, precision, tp, f"parallel.pp={pp}", "model.n_core=4", *extra)


def step_dir(run_dir: Path, step: int) -> Path:
    path = run_dir / "checkpoints" / f"step_{step:08d}"
    assert (path / "COMMIT").is_file(), f"no committed checkpoint at {path}"
    return path


@pytest.fixture(scope="module")
def runs(tiny_shards, tmp_path_factory):
    """Every job of this file: pp2 x dp2 on 4 processes, then one process here, then tp2 and pp2 on 2 processes."""
    out = tmp_path_factory.mktemp("pp_ckpt")
    stop = f"train.stop_at_step={SAVE}"
    saving = [("pp first", overrides(tiny_shards, out / "pp", STEPS, "fp64", 1, 2, stop), True),
              ("pp rest", overrides(tiny_shards, out / "pp", STEPS, "fp64", 1, 2))]
    spawn(worker, 4, str(TINY), saving, str(out / "w4.pt"))
    results = torch.load(out / "w4.pt")
    pp_ckpt = [f"checkpoint.resume={step_dir(out / 'pp', SAVE)}"]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results["one from pp"] = loaded_state(str(TINY), overrides(tiny_shards, out / "one", STEPS, "fp64",
                                                                   1, 1, *pp_ckpt))
        results["one continued"] = run(str(TINY), overrides(tiny_shards, out / "one", STEPS, "fp64", 1, 1, *pp_ckpt))
        results["one first"] = run(str(TINY), overrides(tiny_shards, out / "ref", STEPS, "fp64", 1, 1, stop), True)
        results["one rest"] = run(str(TINY), overrides(tiny_shards, out / "ref", STEPS, "fp64"))
    finally:
        torch.set_num_threads(threads)
    one_ckpt = [f"checkpoint.resume={step_dir(out / 'ref', SAVE)}"]

    checks = [("tp2 from pp", overrides(tiny_shards, out / "tp", STEPS, "fp64", 2, 1, *pp_ckpt)),
              ("pp2 from one", overrides(tiny_shards, out / "pp2", STEPS, "fp64", 1, 2, *one_ckpt))]
    fp32 = 2 * FP32_HALF
    jobs = [("tp continued", overrides(tiny_shards, out / "tp", STEPS, "fp64", 2, 1, *pp_ckpt)),
            ("pp2 continued", overrides(tiny_shards, out / "pp2", STEPS, "fp64", 1, 2, *one_ckpt)),
            ("straight", overrides(tiny_shards, out / "a", fp32, "fp32", 1, 2)),
            ("first", overrides(tiny_shards, out / "b", fp32, "fp32", 1, 2, f"train.stop_at_step={FP32_HALF}")),
            ("second", overrides(tiny_shards, out / "b", fp32, "fp32", 1, 2))]
    spawn(resume_worker, 2, str(TINY), checks, jobs, str(out / "w2.pt"))
    return results | torch.load(out / "w2.pt")


def compare_loaded(label: str, loaded: dict, saved: dict) -> None:
    """The state `loaded` gathered after restoring equals what the saving run held, array by array (torch.equal),
    and every piece equals the checkpoint's region."""
    held = saved["state"]
    differ = sorted(n for n, t in held.items() if n not in loaded["state"] or not torch.equal(loaded["state"][n], t))
    extra = sorted(set(loaded["state"]) - set(held))
    print(f"{label}: restored step {loaded['start']}, {len(held)} arrays ({sum(t.numel() for t in held.values()):,} "
          f"values) gathered over the ranks, {len(differ)} differ from the saving run's, {len(extra)} unexpected; "
          f"{sum(loaded['pieces'])} pieces equal the checkpoint's regions: "
          f"{not any(loaded['mismatched'])}")
    assert loaded["start"] == SAVE
    assert not saved["inconsistent"] and not loaded["inconsistent"]  # replicas (tied embedding copies) agree
    assert not differ and not extra, (differ[:5], extra[:5])
    assert not any(loaded["mismatched"]), loaded["mismatched"]
    assert set(held) == set(loaded["arrays"])


def compare_continued(label: str, got: dict, ref: dict) -> None:
    assert got["start"] == ref["start"] == SAVE and len(got["losses"]) == len(ref["losses"]) == STEPS - SAVE
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
    param_err = max(max_rel_err(got["params"][n], p) for n, p in ref["params"].items())
    print(f"{label}: steps {SAVE}..{STEPS - 1} continued, worst loss rel err {loss_err:.1e}, worst param err "
          f"{param_err:.1e}")
    assert set(got["params"]) == set(ref["params"])
    assert loss_err <= FP64_TOL and param_err <= FP64_TOL


LOADED_IN = {"one from pp": "one process", "tp2 from pp": "tp2"}


@pytest.mark.multiproc
@pytest.mark.parametrize("label", list(LOADED_IN))
def test_pp2_dp2_checkpoint_loads_bit_for_bit(label, runs):
    compare_loaded(f"pp2 x dp2 checkpoint in {LOADED_IN[label]}", runs[label], runs["pp first"])


@pytest.mark.multiproc
@pytest.mark.parametrize("label", ["one continued", "tp continued"])
def test_continuing_a_pp2_dp2_checkpoint_matches_pp2_dp2(label, runs):
    compare_continued(f"pp2 x dp2 checkpoint, {label} (against pp2 x dp2)", runs[label], runs["pp rest"])


@pytest.mark.multiproc
def test_pp2_stop_and_rerun_equals_straight_run_bitwise(runs):
    a, first, second = runs["straight"], runs["first"], runs["second"]
    assert first["interrupted"] and first["done"] == FP32_HALF
    assert second["start"] == FP32_HALF and second["done"] == 2 * FP32_HALF
    losses = first["losses"] + second["losses"]
    same = all(torch.equal(second["params"][n], p) for n, p in a["params"].items())
    print(f"pp2: {2 * FP32_HALF} straight {a['losses'][0]:.6f} .. {a['losses'][-1]:.6f}; {FP32_HALF} + {FP32_HALF} "
          f"identical losses {losses == a['losses']}, identical parameters {same}")
    assert set(second["params"]) == set(a["params"])
    assert losses == a["losses"]
    assert same


@pytest.mark.multiproc
def test_one_process_checkpoint_resumes_under_pp2(runs):
    compare_loaded("one-process checkpoint under pp2", runs["pp2 from one"], runs["one first"])
    compare_continued("one-process checkpoint, pp2 continued (against one process)", runs["pp2 continued"],
                      runs["one rest"])


def stage_optimizers():
    """Two optimizers over the two halves of one parameter set, as two pipeline stages hold it."""
    params = {"a.weight": torch.nn.Parameter(torch.ones(4, 4)), "a.bias": torch.nn.Parameter(torch.ones(4)),
              "b.weight": torch.nn.Parameter(torch.ones(4, 4)), "b.bias": torch.nn.Parameter(torch.ones(4))}
    halves = [[n for n in params if n.startswith(prefix)] for prefix in ("a.", "b.")]
    return [build_optimizer([(n, params[n]) for n in half], OptimConfig(), 10) for half in halves]


def test_stage_scalars_merge_into_the_jobs_and_missing_names_are_refused():
    stages = stage_optimizers()
    per_rank = [{"format": "x", "iteration": 3, "num_skipped": 0, "adamw_step": {f"{s}.bias": 3.0},
                 **parameter_names(opt)} for s, opt in zip("ab", stages)]
    merged = merge_scalars(per_rank)
    assert merged["muon_names"] == ["a.weight", "b.weight"] and merged["adamw_names"] == ["a.bias", "b.bias"]
    assert merged["adamw_step"] == {"a.bias": 3.0, "b.bias": 3.0} and merged["iteration"] == 3
    check_saved_names(merged, join_names([parameter_names(opt) for opt in stages]))  # both stages: accepted
    with pytest.raises(ValueError, match=r"missing \['b.weight'\]"):
        check_saved_names(merge_scalars(per_rank[:1]), join_names([parameter_names(opt) for opt in stages]))
    with pytest.raises(ValueError, match=r"unexpected \['b.weight'\]"):
        check_saved_names(merged, parameter_names(stages[0]))
    with pytest.raises(ValueError, match="iteration 4"):
        merge_scalars([per_rank[0], per_rank[1] | {"iteration": 4}])
