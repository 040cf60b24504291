"""Distributed Muon (each matrix orthogonalised by one owner, updates shared) and ZeRO-1 AdamW (state
sharded by elements over dp), driven by megaloop's combined optimizer, equal the single-process optimizer: same
global grad norm (clipping over tp without double counting) and parameters within 1e-6 after 3 steps; the
optimizer state per rank is total/dp to within one matrix (printed for dp 1, 2, 4). Polar Express runs in fp32 here
(bf16 rounding would amplify float reduction-order noise; see workers_optim)."""
from __future__ import annotations

import pytest
import torch

from megaloop.optim import build_optimizer
from megaloop.optim.muon import init_muon_state
from tests.pipeline.models import make_model, max_rel_err, optim_config, synthetic_grads
from tests.pipeline.spawn import spawn
from tests.pipeline.workers_optim import ORTH_DTYPE, STEPS, clip_for, worker

CASE = "parcae"
TOL = 1e-6
NORM_TOL = 1e-5


def single_process(clip: float):
    torch.set_num_threads(1)  # bf16 matmuls round differently with other thread counts; the workers use 1
    model = make_model(CASE)
    opt = build_optimizer(model.named_parameters(), optim_config(grad_clip=clip), STEPS)
    opt.muon.orth_dtype = ORTH_DTYPE
    norms = []
    for step in range(STEPS):
        for name, g in synthetic_grads(model, step).items():
            dict(model.named_parameters())[name].grad = g
        norms.append(opt.step(step).grad_norm)
        opt.zero_grad()
    muon_bytes = sum(t.numel() * t.element_size() for st in opt.muon.state.values() for t in st.values())
    adamw_bytes = sum(t.numel() * t.element_size() for st in opt.adamw.state.values() for t in st.values()
                      if torch.is_tensor(t))
    largest = max(sum(t.numel() * t.element_size() for t in init_muon_state(p).values())
                  for group in opt.muon.param_groups for p in group["params"])
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return params, norms, muon_bytes, adamw_bytes, largest, len(opt.adamw.state)


@pytest.fixture(scope="module")
def references():
    return {tp: single_process(clip_for(tp)) for tp in (1, 2)}


def check_layout(result, reference):
    params, norms, muon_total, adamw_total, largest, n_adamw = reference
    dp, tp = result["dp"], result["tp"]
    for got, want in zip(result["norms"], norms):  # fp32 per-tensor norms: a split tensor rounds differently
        assert abs(got - want) <= NORM_TOL * want, f"grad norm {got} != {want}"
    worst = max((max_rel_err(result["params"][n], p), n) for n, p in params.items())
    print(f"tp={tp} dp={dp}: grad norms {['%.6f' % x for x in result['norms']]}, worst param err {worst[0]:.2e} "
          f"({worst[1]})")
    assert worst[0] <= TOL
    for rank, b in enumerate(result["bytes"]):
        adamw_note = f"total/dp = {adamw_total / dp:,.0f}" if tp == 1 else "embeddings split over tp too"
        print(f"  rank {rank}: {b['muon_type']} state {b['muon']:,} B (total/(dp*tp) = "
              f"{muon_total / (dp * tp):,.0f}), {b['adamw_type']} state {b['adamw']} B ({adamw_note})")
        assert abs(b["muon"] - muon_total / (dp * tp)) <= largest
        if tp == 1:  # torch keeps a 4-byte step counter per tensor (ZeRO: one per flat shard); padding < dp elements
            assert abs(b["adamw"] - adamw_total / dp) <= 4 * n_adamw + 8 * dp
    assert sum(b["muon"] for b in result["bytes"]) == muon_total  # every matrix has exactly one owner


def test_single_process_state_bytes(references):
    _, _, muon_total, adamw_total, largest, _ = references[1]
    print(f"dp=1: Muon state {muon_total:,} B, AdamW state {adamw_total:,} B, largest matrix state {largest:,} B")


@pytest.mark.multiproc
@pytest.mark.parametrize("world,tps", [(2, [1, 2]), (4, [1, 2])])
def test_distributed_optimizer_equals_single_process(world, tps, references, tmp_path):
    out = tmp_path / "opt.pt"
    spawn(worker, world, CASE, tps, str(out))
    results = torch.load(out)
    for tp in tps:
        check_layout(results[tp], references[tp])
