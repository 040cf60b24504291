"""Distributed Muon (each matrix orthogonalised by one owner) and ZeRO-1 AdamW (state for the AdamW elements of a
rank's chunk of the gradient buffer), built into megaloop's combined optimizer by the runtime, equal the
single-process optimizer in float64: same global grad norm (clipping that bites, counted over chunks and over tp
without double counting) and parameters within 1e-12 after 3 steps. Every matrix has one owner and the Muon state
per rank is total/(dp*tp) to within one matrix; the AdamW state over the ranks adds up to the single-process one;
the buffer's equal chunks carry at most a few elements of padding (printed for dp 1, 2, 4)."""
from __future__ import annotations

import pytest
import torch

from megaloop.optim import build_optimizer
from megaloop.optim.muon import init_muon_state
from pipeline.grad_buffer import ALIGN
from tests.pipeline.models import max_rel_err, optim_config, synthetic_grads
from tests.pipeline.spawn import spawn
from tests.pipeline.workers_optim import ORTH_DTYPE, STEPS, double_model, worker

CASE = "parcae"
TOL = 1e-12


def single_process():
    model = double_model(CASE)
    opt = build_optimizer(model.named_parameters(), optim_config(), STEPS)
    opt.muon.orth_dtype = ORTH_DTYPE
    norms = []
    for step in range(STEPS):
        for name, g in synthetic_grads(model, step).items():
            dict(model.named_parameters())[name].grad = g.double()
        norms.append(opt.step(step).grad_norm)
        opt.zero_grad()
    muon_bytes = sum(t.numel() * t.element_size() for st in opt.muon.state.values() for t in st.values())
    adamw_moments = sum(st[k].numel() * st[k].element_size() for st in opt.adamw.state.values()
                        for k in ("exp_avg", "exp_avg_sq"))
    largest = max(sum(t.numel() * t.element_size() for t in init_muon_state(p).values())
                  for group in opt.muon.param_groups for p in group["params"])
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return params, norms, muon_bytes, adamw_moments, largest


@pytest.fixture(scope="module")
def reference():
    return single_process()


def check_layout(result, reference):
    params, norms, muon_total, adamw_total, largest = reference
    dp, tp = result["dp"], result["tp"]
    norm_err = max(abs(got - want) / want for got, want in zip(result["norms"], norms))
    worst = max((max_rel_err(result["params"][n], p), n) for n, p in params.items())
    print(f"tp={tp} dp={dp}: grad norms {['%.6f' % x for x in result['norms']]} (rel err {norm_err:.1e}, clip 1.0), "
          f"worst param err {worst[0]:.2e} ({worst[1]})")
    assert norm_err <= TOL
    assert worst[0] <= TOL
    for rank, b in enumerate(result["bytes"]):
        print(f"  rank {rank}: {b['muon_type']} state {b['muon']:,} B (total/(dp*tp) = "
              f"{muon_total / (dp * tp):,.0f}), {b['adamw_type']} state {b['adamw']:,} B; buffer groups "
              + ", ".join(f"{'lookups' if late else 'main'} {chunks} x {chunk_len:,} for {numel:,} elements"
                          for chunk_len, chunks, numel, late, _ in b["chunking"]))
        assert abs(b["muon"] - muon_total / (dp * tp)) <= largest
        assert [late for *_, late, _ in b["chunking"]] == [False, True]
        for chunk_len, chunks, numel, late, biggest in b["chunking"]:
            assert chunks == dp
            # the embeddings are cut to fill their chunks; the main group's parameters lie whole in one chunk each,
            # so a chunk may exceed the mean by up to one parameter
            room = ALIGN if late else biggest + ALIGN
            assert chunk_len <= -(-numel // dp) + room
    assert sum(b["muon"] for b in result["bytes"]) == muon_total  # every matrix has exactly one owner
    if tp == 1:  # moments of every AdamW element on exactly one rank, plus one step counter per run of elements
        extra = sum(b["adamw"] for b in result["bytes"]) - adamw_total
        assert 0 <= extra <= 8 * 4 * dp


@pytest.mark.multiproc
@pytest.mark.parametrize("world,tps", [(2, [1, 2]), (4, [1, 2])])
def test_distributed_optimizer_equals_single_process(world, tps, reference, tmp_path):
    out = tmp_path / "opt.pt"
    spawn(worker, world, CASE, tps, str(out))
    results = torch.load(out)
    for tp in tps:
        check_layout(results[tp], reference)
