"""Megaloop's trainer on parcae-tiny (12 steps here, 20 in the benchmark; per-sequence depth sampling, gradient
accumulation, Muon + AdamW, gloo) under tp2 and dp2 (fp64 and fp32) and tp2 x dp2 (fp64), and GPT and RDM under
tp2 (fp64), against the single-process run. The whole matrix (tp4, dp4, tp2 x dp2 of every architecture, every layout
in both precisions) is `python benchmarks/layout_equivalence.py`.

fp64 (train.precision=fp64: parameters, activations and Polar Express in float64) is the proof: every layout gives
the single-process per-step losses AND final parameters within 1e-12, so the parallel computation is the
single-process one.

fp32 is a sanity bound only: per-step losses within 1e-5 relative, final parameters within 5e-3 relative. Parameters
cannot be held tighter in fp32 by any layout: the reference's AdamW eps (1e-10) makes the update g / (|g| + eps)
sensitive to a gradient's last bits wherever |g| is near eps (up to lr / (4 eps) per unit of gradient), and Muon's
cautious weight decay is a step function of sign(update * param), so reduction-order roundings (~1e-7) grow to ~1e-3
of single entries within 20 steps (measured: up to 1.6e-3 between one process on 1 and on 2 threads when the init
still depended on the thread count)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.pipeline.models import max_rel_err
from tests.pipeline.spawn import spawn
from tests.pipeline.workers_train import ReferenceRuntime, run, worker

TINY = Path(__file__).resolve().parents[2] / "configs" / "parcae-tiny.yaml"  # shards: the tiny_shards fixture

TOL = 1e-12  # fp64: losses and parameters
FP32_LOSS_TOL = 1e-5  # fp32 sanity bounds (see the module docstring)
FP32_PARAM_TOL = 5e-3
PRECISIONS = ("fp32", "fp64")
STEPS = 12  # the benchmark runs 20 (it sets this before running)
ARCH = {
    "parcae": [],
    "gpt": ["model.arch=gpt", "model.injection=none", "model.prelude_norm=false", "model.use_C=false",
            "model.mu_rec=1", "model.mu_bwd=1", "model.depth_sampler=fixed", "model.n_prelude=0", "model.n_core=4",
            "model.n_coda=0"],
    "rdm": ["model.arch=rdm", "model.injection=concat", "model.block=sandwich", "model.use_C=false"],
}


def overrides(shards, out_dir, arch: str, precision: str, tp: int = 1) -> list[str]:
    """parcae-tiny on the 32-token test shards: 16 rows per step in micro-batches of 2 (8 per step on one
    process, 2 per rank at dp 4), STEPS steps."""
    return [f"data.shards={shards}", f"train.out_dir={out_dir}", f"train.steps={STEPS}", "model.vocab_size=512",
            "model.seq_len=32", "data.micro_batch_size=2", "data.global_batch_size=16", "data.val_batches=1",
            "train.val_every=1000", "train.progress=false", f"train.precision={precision}", f"parallel.tp={tp}",
            *ARCH[arch]]


def worst_param_err(got: dict, ref: dict) -> tuple[float, str]:
    return max((max_rel_err(got[n], p), n) for n, p in ref.items())


def single_process(shards, out, arch: str, precision: str, threads: int) -> dict:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return run(str(TINY), overrides(shards, out, arch, precision), lambda c, d: ReferenceRuntime(d))
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def references(tiny_shards, tmp_path_factory):
    """reference(arch, precision): the single-process run on one thread, like the workers, made when first asked
    for; in fp32 also the noise floor: how far the same run's parameters move on two threads."""
    out = tmp_path_factory.mktemp("ref")
    made = {}

    def reference(arch: str, precision: str) -> dict:
        if (arch, precision) not in made:
            made[arch, precision] = reference_run(tiny_shards, out, arch, precision)
        return made[arch, precision]
    return reference


def reference_run(shards, out: Path, arch: str, precision: str) -> dict:
    ref = single_process(shards, out / f"{arch}-{precision}", arch, precision, threads=1)
    ref["floor"] = 0.0
    if precision == "fp32":
        two = single_process(shards, out / f"{arch}-{precision}-2", arch, precision, threads=2)
        ref["floor"] = worst_param_err(two["params"], ref["params"])[0]
        print(f"{arch} fp32: single-process parameters move by {ref['floor']:.1e} from 1 to 2 threads")
    return ref


def compare(label: str, precision: str, got: dict, ref: dict) -> None:
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
    worst = worst_param_err(got["params"], ref["params"])
    floor = f"; thread noise floor {ref['floor']:.1e}" if precision == "fp32" else ""
    if got["overlapped"] is not None:  # data parallel: the trainer reduced gradient buckets during the backward
        floor += f"; {got['overlapped']} bucket(s) reduced during the last backward"
        assert got["overlapped"] >= 1
    print(f"{label} {precision}: {STEPS} losses {got['losses'][0]:.6f} .. {got['losses'][-1]:.6f}, worst loss rel err "
          f"{loss_err:.1e}, worst param err {worst[0]:.1e} ({worst[1]}{floor})")
    assert len(got["losses"]) == len(ref["losses"]) == STEPS
    assert all(p.dtype == (torch.float64 if precision == "fp64" else torch.float32) for p in got["params"].values())
    assert loss_err <= (TOL if precision == "fp64" else FP32_LOSS_TOL)
    assert worst[0] <= (TOL if precision == "fp64" else max(FP32_PARAM_TOL, 2 * ref["floor"]))


# label -> (architecture, tp, precisions); dp = world / tp
MATRIX = {
    2: {"tp2": ("parcae", 2, PRECISIONS), "dp2": ("parcae", 1, PRECISIONS), "gpt tp2": ("gpt", 2, PRECISIONS),
        "rdm tp2": ("rdm", 2, PRECISIONS)},
    4: {"tp2xdp2": ("parcae", 2, PRECISIONS), "tp4": ("parcae", 4, PRECISIONS), "dp4": ("parcae", 1, PRECISIONS),
        "gpt tp2xdp2": ("gpt", 2, PRECISIONS), "rdm tp2xdp2": ("rdm", 2, PRECISIONS)},
}
# The representative subset: both dimensions in both precisions on 2 processes, each architecture's tensor-parallel
# plan in the trainer on 2 processes (fp64, the proof), and their composition on the one 2 x 2 grid (fp64): the grid
# is what 2 processes cannot build (each rank in a tp group and a dp group at once: tp-sharded gradients reduced
# over dp, distributed Muon's gathers within tp groups beside ZeRO-1's sharding over dp); fp32 and the other
# architectures add no code path there that the 2-process runs leave out.
SUITE = {
    2: {"tp2": MATRIX[2]["tp2"], "dp2": MATRIX[2]["dp2"], "gpt tp2": ("gpt", 2, ("fp64",)),
        "rdm tp2": ("rdm", 2, ("fp64",))},
    4: {"tp2xdp2": ("parcae", 2, ("fp64",))},
}


def layout_runs(shards, root: Path, layouts: dict) -> dict:
    return {(label, precision): overrides(shards, root / f"{label.replace(' ', '_')}-{precision}", arch, precision,
                                          tp)
            for label, (arch, tp, precisions) in layouts.items() for precision in precisions}


@pytest.mark.multiproc
@pytest.mark.parametrize("world", sorted(SUITE))
def test_layouts_equal_single_process(world, references, tiny_shards, tmp_path):
    layouts = SUITE[world]
    runs = layout_runs(tiny_shards, tmp_path, layouts)
    out = tmp_path / "runs.pt"
    spawn(worker, world, str(TINY), runs, str(out))
    results = torch.load(out)
    for label, precision in runs:
        compare(label, precision, results[label, precision], references(layouts[label][0], precision))
