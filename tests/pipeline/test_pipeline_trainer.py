"""Megaloop's trainer with the ring pipeline (parallel.pp > 1) against the single-process run: parcae-tiny with 4
core blocks, per-sequence depths (micro-batches of different lap counts, rows joining the ragged loop late),
truncated backprop, Muon + AdamW, 8 steps, the final validation at every depth 1 .. 2 mu_rec; point-to-point under
NCCL's rendezvous semantics (parallel.p2p_semantics=rendezvous, emulated on gloo).

fp64 is the proof: per-step losses, final parameters (every stage's, gathered) and validation losses within 1e-12 of
one process; both copies of the tied embedding (first and last stage) identical. fp32 is a sanity bound (losses
within 1e-3, as the acceptance asks; see tests/pipeline/test_layout_equivalence.py for why parameters drift in fp32).
The layouts, references and bounds live in tests/pipeline/pp_equivalence.py. The suite runs pp2 in both precisions,
GPT and RDM at pp2, and pp2 x dp2, pp4 and pp2 x tp2 in fp64; benchmarks/pipeline_equivalence.py runs the whole
matrix in both precisions, GPT and RDM at pp2 x dp2 and pp2 x tp2 x dp2 on 8 processes included."""
from __future__ import annotations

import pytest
import torch

from tests.pipeline.pp_equivalence import (ARCH, LAYOUTS, TINY, describe, failures, layout_runs, measure,
                                           references)
from tests.pipeline.spawn import spawn
from tests.pipeline.workers_pp import worker


def compare(label: str, precision: str, got: dict, ref: dict) -> None:
    m = measure(got, ref)
    print(describe(label, precision, m))
    bad = failures(LAYOUTS[label], precision, m)
    assert not bad, f"{label} {precision}: " + "; ".join(bad)


@pytest.fixture(scope="module")
def pp_references(tiny_shards, tmp_path_factory):
    return references(tiny_shards, tmp_path_factory.mktemp("ref"), ARCH, fp64_only=("gpt", "rdm"))


# The suite's subset: the ring alone (pp2) in both precisions; GPT's and RDM's stage plans on the 2-process ring and
# the 4-process cases in fp64, the proof, only. Each 4-process case is something 2 processes cannot build: pp x dp
# (ring groups beside dp groups), pp x tp (tensor-parallel stages) and pp4 (stages that are neither first nor last);
# fp32 and the other architectures add no code path there. The benchmark runs every layout in both precisions.
FP64_ONLY = ("gpt-pp2", "rdm-pp2", "pp2xdp2", "pp4", "pp2xtp2")


@pytest.mark.multiproc
@pytest.mark.parametrize("world,labels", [
    (2, ["pp2", "gpt-pp2", "rdm-pp2"]),
    (4, ["pp2xdp2", "pp4", "pp2xtp2"]),
])
def test_pipeline_layouts_equal_single_process(world, labels, pp_references, tiny_shards, tmp_path):
    assert all(LAYOUTS[label].world == world for label in labels)
    runs = layout_runs(tiny_shards, tmp_path, labels, FP64_ONLY)
    out = tmp_path / "runs.pt"
    spawn(worker, world, str(TINY), runs, str(out))
    results = torch.load(out)
    for (label, precision) in runs:
        compare(label, precision, results[label, precision], pp_references[LAYOUTS[label].arch, precision])


def test_failures_name_each_broken_bound():
    """The comparison flags a loss, a parameter, a validation loss or an embedding copy off by more than its bound,
    and accepts the same run within it (hand-made results, no training)."""
    ref = {"losses": [2.0] * 8, "params": {"w": torch.ones(3, dtype=torch.float64)},
           "val": {1: {"tokens": 64, "val_loss": 4.0}}}

    def broken(loss=0.0, param=0.0, val=0.0, spread=0.0, precision="fp64", label="pp2"):
        got = {"losses": [2.0 * (1 + loss)] * 8, "params": {"w": torch.ones(3, dtype=torch.float64) * (1 + param)},
               "val": {1: {"tokens": 64, "val_loss": 4.0 * (1 + val)}}, "copies_spread": spread}
        return failures(LAYOUTS[label], precision, measure(got, ref))

    assert broken(loss=1e-13, param=1e-13, val=1e-13) == []
    assert broken(loss=5e-4, param=1e-2, val=1e-2, precision="fp32") == []
    assert [len(broken(**{k: 1e-11})) for k in ("loss", "param", "val")] == [1, 1, 1]
    assert len(broken(loss=2e-3, precision="fp32")) == 1
    assert len(broken(spread=1e-16)) == 1
