"""The pipeline-trainer equivalence check, shared by tests/pipeline/test_pipeline_trainer.py (a subset of layouts)
and benchmarks/pipeline_equivalence.py (the whole matrix): the layouts, the run's overrides, the single-process
references and the comparison of a pipeline run against them.

A run is parcae-tiny with 4 core blocks (or GPT / RDM), per-sequence depths, 8 steps of 16 rows in micro-batches of
2, validation at every depth 1 .. 2 mu_rec at the end. fp64 must give the single-process per-step losses, final
parameters and validation losses within 1e-12 (validation only without dp: data.val_batches counts per dp rank, so
under dp the validation set is another one); fp32 losses within 1e-3. Both copies of the tied embedding (first and
last stage) must be identical."""
from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import torch

from tests.pipeline.test_layout_equivalence import ARCH, TINY, worst_param_err
from tests.pipeline.workers_train import ReferenceRuntime, run

TOL = 1e-12
FP32_LOSS_TOL = 1e-3
STEPS = 8
PRECISIONS = ("fp32", "fp64")
CORE4 = ["model.n_core=4"]


class Layout(NamedTuple):
    arch: str
    pp: int
    tp: int = 1
    dp: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.tp * self.dp


LAYOUTS = {
    "pp2": Layout("parcae", 2),
    "pp4": Layout("parcae", 4),
    "pp2xtp2": Layout("parcae", 2, tp=2),
    "pp2xdp2": Layout("parcae", 2, dp=2),
    "pp2xtp2xdp2": Layout("parcae", 2, tp=2, dp=2),
    "gpt-pp2": Layout("gpt", 2),
    "rdm-pp2": Layout("rdm", 2),
    "gpt-pp2xdp2": Layout("gpt", 2, dp=2),
    "rdm-pp2xdp2": Layout("rdm", 2, dp=2),
}


def overrides(shards, out_dir, arch: str, precision: str, pp: int = 1, tp: int = 1) -> list[str]:
    """parcae-tiny (4 core blocks) on the 32-token test shards: 16 rows per step in micro-batches of 2, 8 steps,
    3 validation batches per dp rank (validation under pp runs them pp at a time around the ring), point-to-point
    under NCCL's rendezvous semantics (emulated on gloo: every send waits for its receive);
    dp is what the world leaves over tp x pp."""
    arch_overrides = [o for o in ARCH[arch] if not o.startswith("model.n_core")]
    return [f"data.shards={shards}", f"train.out_dir={out_dir}", f"train.steps={STEPS}", "model.vocab_size=512",
            "model.seq_len=32", "data.micro_batch_size=2", "data.global_batch_size=16", "data.val_batches=3",
            "train.val_every=1000", "train.progress=false", f"train.precision={precision}", f"parallel.tp={tp}",
            f"parallel.pp={pp}", "parallel.p2p_semantics=rendezvous", *CORE4, *arch_overrides]


def layout_runs(shards, out_dir: Path, labels, fp64_only=()) -> dict:
    """{(label, precision): overrides} of the given layouts in both precisions (the labels in `fp64_only`: fp64,
    the proof, only), each in its own out_dir."""
    return {(label, precision): overrides(shards, out_dir / f"{label}-{precision}", LAYOUTS[label].arch, precision,
                                          LAYOUTS[label].pp, LAYOUTS[label].tp)
            for label in labels for precision in PRECISIONS if precision == "fp64" or label not in fp64_only}


def references(shards, out_dir: Path, archs, fp64_only=()) -> dict:
    """{(arch, precision): single-process run on one thread} with losses, params and val ({depth: summary})."""
    refs = {}
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for arch in archs:
            for precision in ("fp64",) if arch in fp64_only else PRECISIONS:
                ref_dir = out_dir / f"{arch}-{precision}"
                refs[arch, precision] = run(str(TINY), overrides(shards, ref_dir, arch, precision),
                                            lambda c, d: ReferenceRuntime(d))
                summary = json.loads((ref_dir / "summary.json").read_text())
                refs[arch, precision]["val"] = {int(t): v for t, v in summary["val"].items()}
    finally:
        torch.set_num_threads(previous)
    return refs


def measure(got: dict, ref: dict) -> dict:
    """How far a pipeline run (workers_pp.run_pp's result) is from its single-process reference: worst relative
    loss error over the steps, worst parameter error (and where), whether validation ran on the same rows, worst
    relative validation error, and the spread between the tied embedding's copies."""
    worst = worst_param_err(got["params"], ref["params"]) if set(got["params"]) == set(ref["params"]) else (
        float("inf"), "parameter names differ")
    return {
        "steps": (len(got["losses"]), len(ref["losses"])),
        "losses": (got["losses"][0], got["losses"][-1]),
        "loss_err": max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"])),
        "param_err": worst[0], "param_worst": worst[1],
        "same_val": all(got["val"][t]["tokens"] == v["tokens"] for t, v in ref["val"].items()),
        "val_err": max(abs(got["val"][t]["val_loss"] - v["val_loss"]) / abs(v["val_loss"])
                       for t, v in ref["val"].items()),
        "depths": sorted(ref["val"]),
        "copies_spread": got["copies_spread"],
    }


def describe(label: str, precision: str, m: dict) -> str:
    """One printed line of measure's figures."""
    val_note = "" if m["same_val"] else " (another validation set under dp)"
    return (f"{label} {precision}: {m['steps'][0]} losses {m['losses'][0]:.6f} .. {m['losses'][1]:.6f}, worst loss "
            f"rel err {m['loss_err']:.1e}, worst param err {m['param_err']:.1e} ({m['param_worst']}), validation at "
            f"T={m['depths']} worst rel err {m['val_err']:.1e}{val_note}; tied embedding copies differ by "
            f"{m['copies_spread']:.1e}")


def failures(layout: Layout, precision: str, m: dict) -> list[str]:
    """What breaks the bounds of the module docstring (empty: the run passes)."""
    bad = []
    if m["steps"] != (STEPS, STEPS):
        bad.append(f"{m['steps'][0]} losses against the reference's {m['steps'][1]} (expected {STEPS})")
    if not m["same_val"] and layout.dp == 1:
        bad.append("validation ran on other rows than the reference's without dp")
    if m["param_worst"] == "parameter names differ":
        bad.append("the gathered parameter names differ from the reference's")
    if m["copies_spread"] != 0.0:
        bad.append(f"the tied embedding's copies differ by {m['copies_spread']:.1e}")
    if precision == "fp64":
        bad += [f"{what} {err:.1e} > {TOL:.0e}" for what, err in
                [("loss err", m["loss_err"]), ("param err", m["param_err"])] if err > TOL]
        if m["same_val"] and m["val_err"] > TOL:
            bad.append(f"validation err {m['val_err']:.1e} > {TOL:.0e}")
    elif m["loss_err"] > FP32_LOSS_TOL:
        bad.append(f"loss err {m['loss_err']:.1e} > {FP32_LOSS_TOL:.0e}")
    return bad
