"""FP8 linear layers (pipeline/fp8.py) on CPU: torchao's recipes reproduced, the looped LM's forward and backward
against fp32 (SQNR, torchao's own thresholds), the gradient of a T-lap FP8 core against an unrolled copy of it, and
the conversion leaving parameter names alone. parcae-140m itself at T = 1, 4, 8 is `benchmarks/fp8_numerics.py`."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from megaloop.model import build_model
from pipeline.fp8 import E4M3, E5M2, Float8Linear, convert_to_float8, first_scales, quantize, scaled_mm
from tests.model.helpers import small_config
from tests.pipeline.fp8_numerics import batch, fp8_vs_fp32, looped_vs_unrolled, nonzero_projections_

torchao_float8 = pytest.importorskip("torchao.float8")

LOGIT_SQNR, GRAD_SQNR = 18.0, 17.0  # torchao's thresholds for its float8 linear tests
ROWWISE_TOL = 4e-3  # torchao's row-wise GEMM writes bf16 (2^-8) before its fp32 output; ours writes fp32 directly


def _rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_linear_matches_torchao(recipe):
    torch.manual_seed(0)
    layer = nn.Sequential(nn.Linear(64, 96, bias=False))
    ref = torchao_float8.convert_to_float8_training(
        copy.deepcopy(layer), config=torchao_float8.Float8LinearConfig.from_recipe_name(recipe))
    ours = copy.deepcopy(layer)
    convert_to_float8(ours, recipe, ("*",))
    x = torch.randn(3, 16, 64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    g = torch.randn(3, 16, 96)
    ya, yb = ref(xa), ours(xb)
    ya.backward(g)
    yb.backward(g)
    pairs = {"y": (yb, ya), "dx": (xb.grad, xa.grad), "dw": (ours[0].weight.grad, ref[0].weight.grad)}
    errors = {k: _rel(a.detach(), b.detach()) for k, (a, b) in pairs.items()}
    print(recipe, errors)
    assert all(e == 0.0 for e in errors.values()) if recipe == "tensorwise" else max(errors.values()) < ROWWISE_TOL
    fp32 = (x @ layer[0].weight.detach().t())
    assert 0 < _rel(yb.detach(), fp32) < 0.1  # it is FP8: neither exact nor far off


@pytest.fixture(scope="module")
def small():
    """parcae-shaped (d 128, 4 heads of 32, 1/2/1 layers) at vocabulary 512 and 32 positions, reference init."""
    cfg = small_config(d_model=128, vocab_size=512, seq_len=32, mu_rec=8, mu_bwd=2, ve_gate_channels=32)
    model = build_model(cfg, device="cpu", seed=0)
    nonzero_projections_(model)
    return cfg, model


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_looped_sqnr_against_fp32(small, recipe):
    """The trainer's default (the core in FP8) with truncated backprop (k = min(T, 2)); with prelude and coda in
    FP8 too the logits lose ~14 dB (the coda feeds them directly): benchmarks/fp8_numerics.py prints both."""
    cfg, model = small
    ids, labels, h0 = batch(cfg, 2, cfg.seq_len)
    for depth in (1, 4, 8):
        got = fp8_vs_fp32(model, recipe, ids, labels, h0, depth, min(depth, cfg.mu_bwd), outer=False)
        print(f"{recipe} T={depth}: logits {got['logits']:.1f} dB, worst grad {got['grad']:.1f} dB ({got['worst']})")
        assert got["converted"] == 2 * 6  # the core's 2 blocks x q, k, v, proj, fc, proj (ve_gate: 32 -> 4)
        assert LOGIT_SQNR <= got["logits"] < 60 and GRAD_SQNR <= got["grad"] < 60


def test_core_gradient_equals_unrolled_copies(small):
    cfg, base = small
    model = copy.deepcopy(base)
    convert_to_float8(model, "tensorwise", ("core.*",))
    ids, labels, h0 = batch(cfg, 2, cfg.seq_len, seed=1)
    for depth, backprop in ((1, 1), (4, 2), (6, 3)):
        errors = looped_vs_unrolled(model, ids, labels, h0, depth, backprop)
        worst = max(errors, key=errors.get)
        print(f"T={depth} k={backprop}: worst rel err {errors[worst]:.1e} ({worst})")
        assert errors[worst] <= 1e-6


def test_conversion_keeps_names_and_lists_skipped_layers():
    cfg = small_config(d_model=64, vocab_size=256, ve_gate_channels=8)
    model = build_model(cfg, device="cpu")
    before = {n: p for n, p in model.state_dict().items()}
    report = convert_to_float8(model, "rowwise", ("core.*", "prelude.*", "coda.*"))
    after = model.state_dict()
    assert list(after) == list(before) and all(after[n].data_ptr() == before[n].data_ptr() for n in before)
    gates = [n for n, _ in model.named_modules() if n.endswith("attn.ve_gate")]
    assert gates and sorted(s.split(" ")[0] for s in report.skipped) == sorted(gates)
    assert "8->4 not multiples of 16" in report.skipped[0]
    converted = {n for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert converted == set(report.converted) and not any(n.startswith(("embed", "injection", "C")) for n in converted)
    assert type(model.injection).__name__ == type(build_model(cfg, device="meta").injection).__name__
    fresh = build_model(cfg, device="cpu", seed=3)
    fresh.load_state_dict(model.state_dict())  # an FP8 model's weights load into a plain one, and back
    model.load_state_dict(fresh.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    model(ids, labels=ids, depth=2)
    assert {k.rsplit(".", 1)[1] for k in first_scales(model)} == {"x", "w"}  # no backward yet: no "g"


def test_bad_fp8_settings_are_one_line_config_errors():
    from megaloop.config import load_config
    from tests.train.conftest import TINY

    for overrides, allowed in ((["train.fp8=e4m3"], "none, tensorwise, rowwise"),
                               (["train.fp8_backend=apex"], "torchao, te"),
                               (["train.fp8_scale_rounding=nearest"], "auto, pow2, none"),
                               (["train.fp8_backend=te", "train.fp8_scale_rounding=pow2"], "use auto")):
        with pytest.raises(ValueError) as err:
            load_config(str(TINY), overrides)
        message = str(err.value)
        assert message.startswith(f"config error: {overrides[-1].split('=')[0]}=") and allowed in message
        assert "\n" not in message
    with pytest.raises(ValueError, match="fp8 recipe"):
        convert_to_float8(nn.Sequential(nn.Linear(16, 16, bias=False)), "delayed", ("*",))


@pytest.mark.parametrize("rowwise", [False, True])
def test_float64_fp8_gemm_is_exact_whatever_the_split(rowwise):
    """In float64 an FP8 GEMM is exact (pipeline/fp8.py's bound), so the contraction split in 2 or 4 parts and summed
    in any order gives the whole GEMM's bits when the scales are powers of 2: checked against a correctly rounded
    sum (math.fsum) of the exact products, for e4m3 x e4m3 (forward) and e5m2 x e4m3 (tensorwise dgrad) operands."""
    g = torch.Generator().manual_seed(5)
    m, k, n = 16, 512, 16
    x = torch.randn(m, k, generator=g, dtype=torch.float64) * torch.logspace(-3, 3, k, dtype=torch.float64)
    w = torch.randn(n, k, generator=g, dtype=torch.float64)
    dim = -1 if rowwise else None
    wq, ws = quantize(w, E4M3, dim, None, True)
    for fmt in (E4M3, E5M2):
        xq, xs = quantize(x, fmt, dim, None, True)
        sb = ws.t() if rowwise else ws
        whole = scaled_mm(xq, wq.t(), xs, sb, torch.float64)
        exact = torch.tensor([[math.fsum(a * b for a, b in zip(xq[i].double().tolist(), wq[j].double().tolist()))
                               for j in range(n)] for i in range(m)], dtype=torch.float64)
        exact = exact * xs.reciprocal().double() * sb.reciprocal().double()
        assert torch.equal(whole, exact)
        for parts in (2, 4):
            pieces = [scaled_mm(a, b, xs, sb, torch.float64) for a, b in zip(xq.chunk(parts, 1), wq.t().chunk(parts))]
            assert torch.equal(sum(pieces), whole) and torch.equal(sum(reversed(pieces)), whole)
        fp32_acc = [torch._scaled_mm(a, b, scale_a=xs.reciprocal(), scale_b=sb.reciprocal(), out_dtype=torch.float64)
                    for a, b in zip(xq.chunk(2, 1), wq.t().chunk(2))]
        print(f"rowwise={rowwise} {fmt}: exact; torch._scaled_mm (CPU) split in 2 vs whole: "
              f"{(sum(fp32_acc) != whole).sum().item()} / {whole.numel()} outputs differ")
