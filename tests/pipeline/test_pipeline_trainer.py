"""Megaloop's trainer with the ring pipeline (parallel.pp > 1) against the single-process run: parcae-tiny with 4
core blocks, per-sequence depths (micro-batches of different lap counts, rows joining the ragged loop late),
truncated backprop, Muon + AdamW, 8 steps, the final validation at every depth 1 .. 2 mu_rec.

fp64 is the proof: per-step losses, final parameters (every stage's, gathered) and validation losses within 1e-12 of
one process; both copies of the tied embedding (first and last stage) identical. fp32 is a sanity bound (losses
within 1e-3, as the acceptance asks; see tests/pipeline/test_layout_equivalence.py for why parameters drift in fp32).
The suite runs pp2 and pp2 x dp2 (GPT and RDM at pp2 x dp2 too) and pp4 / pp2 x tp2 (x dp2) in
benchmarks/parallel_layouts.py --pipeline."""
from __future__ import annotations

import pytest
import torch

from tests.pipeline.spawn import spawn
from tests.pipeline.test_layout_equivalence import ARCH, TINY, worst_param_err
from tests.pipeline.workers_pp import worker
from tests.pipeline.workers_train import ReferenceRuntime, run

TOL = 1e-12
FP32_LOSS_TOL = 1e-3
STEPS = 8
CORE4 = ["model.n_core=4"]


def overrides(shards, out_dir, arch: str, precision: str, pp: int = 1, tp: int = 1) -> list[str]:
    """parcae-tiny (4 core blocks) on the 32-token test shards: 16 rows per step in micro-batches of 2, 8 steps."""
    arch_overrides = [o for o in ARCH[arch] if not o.startswith("model.n_core")]
    return [f"data.shards={shards}", f"train.out_dir={out_dir}", f"train.steps={STEPS}", "model.vocab_size=512",
            "model.seq_len=32", "data.micro_batch_size=2", "data.global_batch_size=16", "data.val_batches=1",
            "train.val_every=1000", "train.progress=false", f"train.precision={precision}", f"parallel.tp={tp}",
            f"parallel.pp={pp}", *CORE4, *arch_overrides]


def compare(label: str, precision: str, got: dict, ref: dict) -> None:
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
    worst = worst_param_err(got["params"], ref["params"])
    # data.val_batches counts per data-parallel rank: the validation set is the reference's only without dp
    same_val = all(got["val"][t]["tokens"] == v["tokens"] for t, v in ref["val"].items())
    val_err = max(abs(got["val"][t]["val_loss"] - v["val_loss"]) / abs(v["val_loss"]) for t, v in ref["val"].items())
    print(f"{label} {precision}: {STEPS} losses {got['losses'][0]:.6f} .. {got['losses'][-1]:.6f}, worst loss rel err "
          f"{loss_err:.1e}, worst param err {worst[0]:.1e} ({worst[1]}), validation at T={sorted(ref['val'])} "
          f"worst rel err {val_err:.1e}{'' if same_val else ' (another validation set under dp)'}; tied embedding copies differ by {got['copies_spread']:.1e}")
    assert len(got["losses"]) == len(ref["losses"]) == STEPS
    assert same_val or "dp" in label
    assert set(got["params"]) == set(ref["params"]) and got["copies_spread"] == 0.0
    if precision == "fp64":
        assert loss_err <= TOL and worst[0] <= TOL and (val_err <= TOL or not same_val)
    else:
        assert loss_err <= FP32_LOSS_TOL


@pytest.fixture(scope="module")
def pp_references(tiny_shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    refs = {}
    for arch in ARCH:
        for precision in ("fp32", "fp64"):
            ref_over = overrides(tiny_shards, out / f"{arch}-{precision}", arch, precision)
            torch.set_num_threads(1)
            refs[arch, precision] = run(str(TINY), ref_over, lambda c, d: ReferenceRuntime(d))
            refs[arch, precision]["val"] = _val(out / f"{arch}-{precision}")
    return refs


def _val(out_dir) -> dict:
    import json

    summary = json.loads((out_dir / "summary.json").read_text())
    return {int(t): v for t, v in summary["val"].items()}


@pytest.mark.multiproc
@pytest.mark.parametrize("world,layouts", [
    (2, {"pp2": ("parcae", 2, 1)}),
    (4, {"pp2xdp2": ("parcae", 2, 1), "pp4": ("parcae", 4, 1), "pp2xtp2": ("parcae", 2, 2),
         "gpt pp2xdp2": ("gpt", 2, 1), "rdm pp2xdp2": ("rdm", 2, 1)}),
])
def test_pipeline_layouts_equal_single_process(world, layouts, pp_references, tiny_shards, tmp_path):
    runs = {(label, precision): overrides(tiny_shards, tmp_path / f"{label.replace(' ', '_')}-{precision}", arch, precision, pp, tp)
            for label, (arch, pp, tp) in layouts.items() for precision in ("fp32", "fp64")}
    out = tmp_path / "runs.pt"
    spawn(worker, world, str(TINY), runs, str(out))
    results = torch.load(out)
    for (label, precision) in runs:
        compare(label, precision, results[label, precision], pp_references[layouts[label][0], precision])
