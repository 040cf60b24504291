"""LoopedLM as ring-pipeline stages (megaloop.model.stages) equals one process in fp64 (1e-12): parcae-tiny with 4
core blocks at pp 2 and 4; its RDM and GPT variants and parcae with activation checkpointing "lap" and "block" at
pp 2; five micro-batches whose per-sequence depths differ within and between them (7, 3, 5, 1 and 6 laps;
rows joining the ragged loop in different laps) with truncated backprop k_i = min(T_i, ceil(mu_rec / 2)) and the
trainer's per-micro-batch token shares as loss scales, scheduled by ring_schedule and run by RingExecutor with
every message's name and shape checked.

Per-micro-batch losses must match the reference's within 1e-12; every parameter's gradient summed over the ranks
(the tied embedding's gets contributions on rank 0 and the last rank) within 1e-12 relative; and each rank's
nonzero gradients must be exactly its stage's parameters, so the split is real. The micro-batch spec's laps, kept
laps and active fractions are checked against hand-counted values, and the inputs the ring cannot run fail with
a clear error."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megaloop.config import load_config
from megaloop.model.stages import (LoopedStageProgram, StageMicroBatch, core_ranges, micro_batch_spec,
                                   stage_end_costs, stage_ranges)
from tests.pipeline.models import max_rel_err
from tests.pipeline.spawn import spawn
from tests.pipeline.workers_ring import build, reference, worker

TOL = 1e-12
CASES = {2: ["parcae", "rdm", "gpt", "parcae+lap", "parcae+block"], 4: ["parcae"]}


def expected_owners(model, pp: int) -> list[set[str]]:
    """The parameters each rank must touch, written out independently of the program: rank 0 the embedding, its
    value tables, prelude, prelude norm and injection; rank r core blocks [r n / pp, (r + 1) n / pp) (n = 4 splits
    evenly); the last rank C, coda, final norm and the tied embedding; each block's value table with its block."""
    n = model.cfg.n_core
    layer_stage = {block.layer: 0 for block in model.prelude}
    layer_stage |= {block.layer: pp - 1 for block in model.coda}
    layer_stage |= {model.core[i].layer: r for r in range(pp) for i in range(r * n // pp, (r + 1) * n // pp)}
    owners = [set() for _ in range(pp)]
    for name, _ in model.named_parameters():
        parts = name.split(".")
        if parts[0] == "core":
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


def summed(parts, case: str, name: str, like: torch.Tensor) -> torch.Tensor:
    """A parameter's gradient summed over the ranks (zero where no rank has one)."""
    return sum((part[case][1][name] for part in parts if name in part[case][1]), torch.zeros_like(like))


def test_core_ranges():
    assert core_ranges(4, 2) == [(0, 1), (2, 3)]
    assert core_ranges(5, 3) == [(0, 1), (2, 3), (4, 4)]
    assert core_ranges(3, 1) == [(0, 2)]
    with pytest.raises(ValueError, match="more pipeline stages than core blocks .*use pp <= n_core"):
        core_ranges(2, 4)


def test_balanced_split_gives_the_end_stages_fewer_core_blocks():
    """parcae-1_3b (prelude, core, coda 8 blocks; d 1536, vocab 32768, mu_rec 8, mu_bwd 4): a core block is
    8 + 2 x 4 = 16 block passes per micro-batch, the prelude 3 x 8 = 24 (1.5 blocks), the coda and head
    3 x (8 + 32768 / (12 x 1536)) = 29.3 (1.83 blocks); at pp 4 the 8 core blocks go 1, 3, 3, 1 (work 2.5, 3, 3,
    2.83 blocks; the even 2, 2, 2, 2 has 3.5 and 3.83 at the ends)."""
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "parcae-1_3b.yaml").model
    first, last = stage_end_costs(cfg)
    assert abs(first - 1.5) < 1e-12 and abs(last - 3 * (8 + 32768 / (12 * 1536)) / 16) < 1e-12
    assert stage_ranges(cfg, 4, "balanced") == [(0, 0), (1, 3), (4, 6), (7, 7)]
    assert stage_ranges(cfg, 4, "even") == core_ranges(8, 4) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert core_ranges(4, 2, (1.5, 0.5)) == [(0, 0), (1, 3)]  # loads 2.5 vs 1.5 + 1: the tie goes to less extra
    with pytest.raises(ValueError, match="unknown pipeline split 'uneven'"):
        stage_ranges(cfg, 4, "uneven")


def test_micro_batch_spec():
    """Depths [3, 7, 1, 5], k = 2: sorted 7, 5, 3, 1 end-aligned over 7 laps; lap t runs the rows with
    T >= 7 - t: 1, 1, 2, 2, 3, 3, 4 of 4; the last 2 laps keep activations."""
    model, batches = build("parcae")
    assert micro_batch_spec(model, batches[0]) == {"laps": 7, "grad_laps": 2,
                                                   "active": (0.25, 0.25, 0.5, 0.5, 0.75, 0.75, 1.0)}
    program = LoopedStageProgram(model, 1, 2, batches)
    assert [program.message_shape(0, lap)[0] for lap in range(7)] == [1, 1, 2, 2, 3, 3, 4]


def test_unsupported_inputs_fail_clearly():
    model, batches = build("parcae")
    ids, labels = batches[0].input_ids, batches[0].labels
    with pytest.raises(ValueError, match="needs backprop depths k_i = min"):
        micro_batch_spec(model, StageMicroBatch(ids, labels, [3, 7, 1, 5], [1, 2, 1, 2]))
    with pytest.raises(ValueError, match="at least one lap with gradient"):
        micro_batch_spec(model, StageMicroBatch(ids, labels, [3, 7, 1, 5], 0))
    with pytest.raises(ValueError, match="one float or one per micro-batch"):
        LoopedStageProgram(model, 0, 2, batches, scale=[0.5, 0.5])
    with pytest.raises(ValueError, match="stage must be in 0..1"):
        LoopedStageProgram(model, 2, 2, batches)
    with pytest.raises(ValueError, match="more pipeline stages than core blocks"):
        LoopedStageProgram(model, 0, 5, batches)


@pytest.mark.multiproc
@pytest.mark.parametrize("pp", sorted(CASES))
def test_stages_equal_single_process(pp, tmp_path):
    out = str(tmp_path / "ring")
    spawn(worker, pp, CASES[pp], out)
    parts = [torch.load(f"{out}.{rank}") for rank in range(pp)]
    for case in CASES[pp]:
        ref_losses, ref_grads = reference(case)
        losses = parts[-1][case][0]
        got = torch.stack([losses[mb] for mb in range(len(ref_losses))])
        loss_err = float((got - ref_losses).abs().max())
        grad_err, worst = max((max_rel_err(summed(parts, case, name, grad), grad), name)
                              for name, grad in ref_grads.items())
        print(f"pp={pp} {case}: max |loss - reference| {loss_err:.1e} (losses {[round(float(v), 5) for v in got]}), "
              f"worst relative gradient error {grad_err:.1e} ({worst})")
        assert loss_err <= TOL and grad_err <= TOL
        owners = expected_owners(build(case)[0], pp)
        for rank, part in enumerate(parts):
            assert set(part[case][1]) == owners[rank], (rank, set(part[case][1]) ^ owners[rank])


def test_states_travel_in_the_message_dtype():
    """message_dtype bf16 on a float64 model: a state leaving for another rank is bf16 (message_dtype() says so),
    the last lap's state, which stays on the last rank for the loss, keeps the model's dtype; a received bf16
    state is computed with in float64 and its gradient goes back in bf16 (the receive buffer's dtype)."""
    model, batches = build("parcae")
    first, last = (LoopedStageProgram(model, s, 2, batches, message_dtype=torch.bfloat16) for s in (0, 1))
    e, h0 = first.embed(0)
    out = first.lap_segment(0, 0, h0, e)
    assert first.message_dtype() == last.message_dtype() == out.dtype == torch.bfloat16
    laps = last.plans[0].laps
    received = out.detach().requires_grad_()
    onward = last.lap_segment(0, 0, received, None)  # lap 0 of 7 goes back to rank 0
    final = last.lap_segment(0, laps - 1, torch.zeros(last.message_shape(0, laps - 1), dtype=torch.bfloat16), None)
    assert onward.dtype == torch.bfloat16 and final.dtype == torch.float64
    onward.float().sum().backward()
    assert received.grad.dtype == torch.bfloat16 and received.grad.abs().sum() > 0
    plain = LoopedStageProgram(model, 0, 2, batches)
    assert plain.message_dtype() == torch.float64 and plain.lap_segment(0, 0, *plain.embed(0)[::-1]).dtype == \
        torch.float64
