"""GPU-only FP8 checks (scripts/gpu_check.sh; skipped without a GPU): the torchao-recipe FP8 layers (pipeline/fp8.py)
on CUDA against fp32 on parcae-140m's looped forward and backward at T = 1, 4, 8 with truncated backprop, the T-lap
FP8 core against unrolled copies, and the Transformer Engine backend (skipped where TE is not installed): its
blocks against the native ones (outputs and gradients, T = 1 and 4), its state_dict keys and the mapping both ways,
its T-lap core against unrolled copies and its recompute under activation checkpointing."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from megaloop.config import load_config
from megaloop.model import build_model
from megaloop.train.fp8 import CORE
from pipeline.fp8 import convert_to_float8
from tests.pipeline.fp8_numerics import (batch, forward_backward, fp8_vs_fp32, looped_vs_unrolled,
                                         nonzero_projections_, sqnr_db)

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]
LOGIT_SQNR, GRAD_SQNR = 18.0, 17.0


def _model(config: str, seq: int | None = None):
    overrides = [f"model.seq_len={seq}"] if seq else []
    cfg = load_config(str(REPO / "configs" / config), overrides).model
    model = build_model(cfg, device="cuda", seed=0)
    nonzero_projections_(model)
    return model, cfg


def _cuda(*tensors):
    return [t.cuda() for t in tensors]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_on_cuda_against_fp32_parcae_140m(recipe):
    model, cfg = _model("parcae-140m.yaml", seq=512)
    ids, labels, h0 = _cuda(*batch(cfg, 2, cfg.seq_len))
    for depth in (1, 4, 8):
        got = fp8_vs_fp32(model, recipe, ids, labels, h0, depth, min(depth, cfg.backprop_depth), outer=False)
        print(f"cuda {recipe} parcae-140m T={depth}: logits {got['logits']:.1f} dB, worst grad {got['grad']:.1f} dB "
              f"({got['worst']})")
        assert got["logits"] >= LOGIT_SQNR and got["grad"] >= GRAD_SQNR


def test_fp8_core_gradient_equals_unrolled_on_cuda():
    model, cfg = _model("parcae-tiny.yaml")
    convert_to_float8(model, "tensorwise", CORE)
    ids, labels, h0 = _cuda(*batch(cfg, 2, cfg.seq_len, seed=1))
    errors = looped_vs_unrolled(model, ids, labels, h0, 6, 3)
    worst = max(errors, key=errors.get)
    print(f"cuda fp8 T=6 k=3 vs unrolled: worst rel err {errors[worst]:.1e} ({worst})")
    assert errors[worst] <= 1e-6


@pytest.fixture(scope="module")
def te():
    from pipeline.te_backend import TransformerEngineUnavailable, require_te

    try:
        return require_te()
    except TransformerEngineUnavailable as err:
        pytest.skip(str(err))


def _te_model(base):
    from pipeline.te_backend import convert_to_te

    model = copy.deepcopy(base)
    report = convert_to_te(model, CORE)
    return model, report


def test_te_blocks_against_native(te):
    base, cfg = _model("parcae-tiny.yaml")
    model, report = _te_model(base)
    print(f"te: {report.summary()}")
    ids, labels, h0 = _cuda(*batch(cfg, 4, cfg.seq_len))
    ours = copy.deepcopy(base)
    convert_to_float8(ours, "tensorwise", CORE)
    for depth in (1, 4):
        k = min(depth, cfg.backprop_depth)
        ref_logits, ref_grads = forward_backward(base, ids, labels, h0, depth, k)
        logits, grads = forward_backward(model, ids, labels, h0, depth, k)
        our_logits, _ = forward_backward(ours, ids, labels, h0, depth, k)
        worst = min(sqnr_db(ref_grads[n], grads[n]) for n in ref_grads if ref_grads[n].norm() > 0)
        print(f"te T={depth}: logits {sqnr_db(ref_logits, logits):.1f} dB vs native fp32, worst grad {worst:.1f} dB; "
              f"TE vs torchao-recipe tensorwise logits {sqnr_db(our_logits, logits):.1f} dB")
        assert set(grads) == set(ref_grads)
        assert sqnr_db(ref_logits, logits) >= LOGIT_SQNR and worst >= GRAD_SQNR


def test_te_state_dict_keys_map_both_ways(te):
    from pipeline.te_backend import native_to_te, te_state_keys, te_to_native

    base, _ = _model("parcae-tiny.yaml")
    keys = te_state_keys(base, CORE)
    model, _ = _te_model(base)
    state = model.state_dict()
    assert list(state) == keys
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in base.named_parameters()]
    fresh = build_model(base.cfg, device="cuda", seed=5)
    fresh.load_state_dict(te_to_native(state), strict=True)
    model.load_state_dict(native_to_te(fresh.state_dict(), keys, state), strict=True)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))


def test_te_core_gradient_equals_unrolled_and_recompute(te):
    base, cfg = _model("parcae-tiny.yaml")
    model, _ = _te_model(base)
    ids, labels, h0 = _cuda(*batch(cfg, 2, cfg.seq_len, seed=1))
    errors = looped_vs_unrolled(model, ids, labels, h0, 6, 3)
    worst = max(errors, key=errors.get)
    print(f"te T=6 k=3 vs unrolled: worst rel err {errors[worst]:.1e} ({worst})")
    assert errors[worst] <= 1e-6
    _, plain = forward_backward(model, ids, labels, h0, 4, 2)
    model.set_activation_checkpointing("block")  # through te.distributed.checkpoint (convert_to_te set it)
    _, recomputed = forward_backward(model, ids, labels, h0, 4, 2)
    err = max(((recomputed[n] - g).abs().max() / g.abs().max().clamp(min=1e-30)).item() for n, g in plain.items())
    print(f"te activation checkpointing (block) vs none: worst grad rel err {err:.1e}")
    assert err <= 1e-6
