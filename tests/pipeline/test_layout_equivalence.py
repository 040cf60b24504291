"""Megaloop's trainer on parcae-tiny (20 steps, per-sequence depth sampling, gradient accumulation,
Muon + AdamW, fp32, gloo) gives the single-process per-step losses within 1e-5 relative under tp2, dp2, tp2 x dp2,
tp4 and dp4, and GPT and RDM under tp2 x dp2. Polar Express runs in fp32 in every run (see workers_train).

Final parameters: 20 steps at these learning rates amplify fp32 rounding (~1e-7) to ~1e-3 of single entries (AdamW
with eps 1e-10 turns the sign of a tiny gradient into a full step; Muon's cautious weight decay is a step function
of sign(update * param)). The single-process run itself moves that far when only its thread count changes
(measured here: the noise floor). So the parameters must be within 1e-5, or within twice the floor: a layout may
change them no more than the thread count does."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.pipeline.models import max_rel_err
from tests.pipeline.spawn import spawn
from tests.pipeline.workers_train import ReferenceRuntime, run, worker

TINY = Path(__file__).resolve().parents[2] / "configs" / "parcae-tiny.yaml"  # shards: the tiny_shards fixture

TOL = 1e-5
ARCH = {
    "parcae": [],
    "gpt": ["model.arch=gpt", "model.injection=none", "model.prelude_norm=false", "model.use_C=false",
            "model.mu_rec=1", "model.mu_bwd=1", "model.depth_sampler=fixed", "model.n_prelude=0", "model.n_core=4",
            "model.n_coda=0"],
    "rdm": ["model.arch=rdm", "model.injection=concat", "model.block=sandwich", "model.use_C=false"],
}


def overrides(shards, out_dir, arch: str, tp: int = 1) -> list[str]:
    """parcae-tiny on the 32-token test shards: 16 rows per step in micro-batches of 2 (8 per step on one
    process, 2 per rank at dp 4), 20 steps, fp32."""
    return [f"data.shards={shards}", f"train.out_dir={out_dir}", "train.steps=20", "model.vocab_size=512",
            "model.seq_len=32", "data.micro_batch_size=2", "data.global_batch_size=16", "data.val_batches=1",
            "train.val_every=1000", "train.progress=false", "train.precision=fp32", f"parallel.tp={tp}",
            *ARCH[arch]]


def worst_param_err(got: dict, ref: dict) -> tuple[float, str]:
    return max((max_rel_err(got[n], p), n) for n, p in ref.items())


@pytest.fixture(scope="module")
def references(tiny_shards, tmp_path_factory):
    """Single-process runs per architecture (one thread, like the workers) and their noise floor: the parameter
    difference to the same run on two threads."""
    out = tmp_path_factory.mktemp("ref")
    refs = {}
    threads = torch.get_num_threads()
    try:
        for arch in ARCH:
            torch.set_num_threads(2)
            two = run(str(TINY), overrides(tiny_shards, out / f"{arch}2", arch), lambda c, d: ReferenceRuntime(d))
            torch.set_num_threads(1)
            refs[arch] = run(str(TINY), overrides(tiny_shards, out / arch, arch), lambda c, d: ReferenceRuntime(d))
            refs[arch]["floor"] = worst_param_err(two["params"], refs[arch]["params"])[0]
            print(f"{arch}: single-process parameters move by {refs[arch]['floor']:.1e} from 1 to 2 threads")
    finally:
        torch.set_num_threads(threads)
    return refs


def compare(label: str, got: dict, ref: dict) -> None:
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
    worst = worst_param_err(got["params"], ref["params"])
    print(f"{label}: 20 losses {got['losses'][0]:.5f} .. {got['losses'][-1]:.5f}, worst loss rel err {loss_err:.1e}, "
          f"worst param err {worst[0]:.1e} ({worst[1]}; thread noise floor {ref['floor']:.1e})")
    assert len(got["losses"]) == len(ref["losses"]) == 20
    assert loss_err <= TOL
    assert worst[0] <= max(TOL, 2 * ref["floor"])


@pytest.mark.multiproc
@pytest.mark.parametrize("world,layouts", [
    (2, {"tp2": ("parcae", 2), "dp2": ("parcae", 1)}),
    (4, {"tp2xdp2": ("parcae", 2), "tp4": ("parcae", 4), "dp4": ("parcae", 1), "gpt tp2xdp2": ("gpt", 2),
         "rdm tp2xdp2": ("rdm", 2)}),
])
def test_layouts_equal_single_process(world, layouts, references, tiny_shards, tmp_path):
    runs = {label: overrides(tiny_shards, tmp_path / label.replace(" ", "_"), arch, tp)
            for label, (arch, tp) in layouts.items()}
    out = tmp_path / "runs.pt"
    spawn(worker, world, str(TINY), runs, str(out))
    results = torch.load(out)
    for label, (arch, _) in layouts.items():
        compare(label, results[label], references[arch])
