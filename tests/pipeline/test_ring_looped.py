"""LoopedLM as ring-pipeline stages (megaloop.model.stages) equals one process in fp64 (1e-12): parcae-tiny with 4
core blocks at pp 2 and 4, its RDM variant at pp 2, five micro-batches whose per-sequence depths differ within and
between them (7, 3, 5, 1 and 6 laps; rows joining the ragged loop in different laps) with truncated backprop
k_i = min(T_i, ceil(mu_rec / 2)) and the trainer's per-micro-batch token shares as loss scales, scheduled by
ring_schedule and run by RingExecutor with every message's name and shape checked.

Per-micro-batch losses must match the reference's within 1e-12; every parameter's gradient summed over the ranks
(the tied embedding's gets contributions on rank 0 and the last rank) within 1e-12 relative; and each rank's
nonzero gradients must be exactly its stage's parameters, so the split is real."""
from __future__ import annotations

import pytest
import torch

from megaloop.model.stages import core_ranges
from tests.pipeline.models import max_rel_err
from tests.pipeline.spawn import spawn
from tests.pipeline.workers_ring import build, reference, worker

TOL = 1e-12
CASES = {2: ["parcae", "rdm"], 4: ["parcae"]}


def expected_owners(model, pp: int) -> list[set[str]]:
    """The parameters each rank must touch, written out independently of the program: rank 0 the embedding, its
    value tables, prelude, prelude norm and injection; rank r core blocks [r n / pp, (r + 1) n / pp) (n = 4 splits
    evenly); the last rank C, coda, final norm and the tied embedding; each block's value table with its block."""
    n = model.cfg.n_core
    names = [name for name, _ in model.named_parameters()]
    layer_stage = {block.layer: 0 for block in model.prelude}
    layer_stage |= {block.layer: pp - 1 for block in model.coda}
    layer_stage |= {model.core[i].layer: r for r in range(pp) for i in range(r * n // pp, (r + 1) * n // pp)}
    owners = [set() for _ in range(pp)]
    for name in names:
        parts = name.split(".")
        if parts[0] in ("core",):
            stages = {int(parts[1]) * pp // n}
        elif parts[0] == "value_embeds":
            stages = {layer_stage[int(parts[1])]}
        elif parts[0] == "embed":
            stages = {0, pp - 1}
        elif parts[0] in ("prelude", "prelude_norm", "injection"):
            stages = {0}
        else:  # C, coda, final_norm
            stages = {pp - 1}
        for stage in stages:
            owners[stage].add(name)
    return owners


def summed(parts, arch: str, name: str, like: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient summed over the ranks (zero where no rank has one)."""
    return sum((part[arch][1][name] for part in parts if name in part[arch][1]), torch.zeros_like(like))


def test_core_ranges():
    assert core_ranges(4, 2) == [(0, 1), (2, 3)]
    assert core_ranges(5, 3) == [(0, 1), (2, 3), (4, 4)]
    assert core_ranges(3, 1) == [(0, 2)]
    with pytest.raises(ValueError, match="more pipeline stages than core blocks .*use pp <= n_core"):
        core_ranges(2, 4)


@pytest.mark.multiproc
@pytest.mark.parametrize("pp", sorted(CASES))
def test_stages_equal_single_process(pp, tmp_path):
    out = str(tmp_path / "ring")
    spawn(worker, pp, CASES[pp], out)
    parts = [torch.load(f"{out}.{rank}") for rank in range(pp)]
    for arch in CASES[pp]:
        ref_losses, ref_grads = reference(arch)
        losses = parts[-1][arch][0]
        got = torch.stack([losses[mb] for mb in range(len(ref_losses))])
        loss_err = float((got - ref_losses).abs().max())
        grad_err, worst = max((max_rel_err(summed(parts, arch, name, grad), grad), name)
                              for name, grad in ref_grads.items())
        print(f"pp={pp} {arch}: max |loss - reference| {loss_err:.1e} (losses {[round(float(v), 5) for v in got]}), "
              f"worst relative gradient error {grad_err:.1e} ({worst})")
        assert loss_err <= TOL and grad_err <= TOL
        owners = expected_owners(build(arch)[0], pp)
        for rank, part in enumerate(parts):
            assert set(part[arch][1]) == owners[rank], (rank, set(part[arch][1]) ^ owners[rank])
