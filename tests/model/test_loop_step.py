"""One loop step equals the formula u = A_bar*h + Delta*(B e); h' = Core(u) re-derived independently,
and the encode / decode seams equal the reference forward; converter round trips are bit-exact and strict."""
import math

import pytest
import torch
import torch.nn.functional as F

from megaloop.model import build_model
from megaloop.model.convert import ConversionError, from_reference_state_dict, to_reference_state_dict
from tests.model.helpers import rand_like_params_, ref_block, ref_rms, small_config

TOL = 1e-6


def _model_and_inputs(**overrides):
    torch.manual_seed(0)
    cfg = small_config(**overrides)
    model = build_model(cfg)
    rand_like_params_(model)
    ids = torch.randint(0, cfg.vocab_size, (3, cfg.seq_len))
    return cfg, model, ids


def _ref_core(u, p, cfg, ids):
    for i in range(cfg.n_core):
        layer = cfg.n_prelude + i
        ve = p[f"value_embeds.{layer}.weight"][ids] if f"value_embeds.{layer}.weight" in p else None
        u = ref_block(u, p, f"core.{i}.", cfg, ve)
    return u


@pytest.mark.parametrize("dtype,tol", [(torch.float32, TOL), (torch.float64, 1e-12)])
def test_one_loop_step_equals_formula(dtype, tol):
    """fp32 (the training precision) to 1e-6; the fp64 verification precision (model.double()) to 1e-12, which
    only holds if every operation, the RoPE tables included, runs in float64."""
    cfg, model, ids = _model_and_inputs()
    model = model.to(dtype)
    p = {k: v.detach().double() for k, v in model.state_dict().items()}
    ctx = model.context(ids)
    e = torch.randn(3, cfg.seq_len, cfg.d_model, dtype=dtype)
    h = torch.randn(3, cfg.seq_len, cfg.d_model, dtype=dtype)
    ours = model.loop_step(h, e, ctx)
    assert ours.dtype == dtype
    e, h = e.double(), h.double()

    delta = torch.log1p(torch.exp(p["injection.dt_bias"]))  # softplus written out
    a_bar = torch.exp(-delta * torch.exp(p["injection.A_log"]))
    u = a_bar * h + delta * (e @ p["injection.B"].T)
    expected = _ref_core(u, p, cfg, ids)
    # the model vs a float64 derivation: max abs error relative to the largest entry (|h'| is O(1-10) here)
    err = ((ours.double() - expected).abs().max() / expected.abs().max()).item()
    print(f"{dtype} loop step max error vs formula (relative to max |h'|): {err:.2e}")
    assert err <= tol


def test_full_forward_equals_reference_derivation():
    cfg, model, ids = _model_and_inputs()
    p = {k: v.detach() for k, v in model.state_dict().items()}
    h0 = 0.1 * torch.randn(3, cfg.seq_len, cfg.d_model)
    out = model(ids, labels=ids, depth=3, h0=h0)

    x = p["embed.weight"][ids]
    x = ref_block(x, p, "prelude.0.", cfg, None)
    e = ref_rms(x, p["prelude_norm.weight"], cfg.norm_eps)
    delta = F.softplus(p["injection.dt_bias"])
    a_bar = torch.exp(-delta * torch.exp(p["injection.A_log"]))
    h = h0
    for _ in range(3):
        h = _ref_core(a_bar * h + delta * (e @ p["injection.B"].T), p, cfg, ids)
    x = h @ p["C.weight"].T
    x = ref_block(x, p, "coda.0.", cfg, p["value_embeds.3.weight"][ids])
    logits = ref_rms(x, p["final_norm.weight"], cfg.norm_eps) @ p["embed.weight"].T
    loss = F.cross_entropy(logits.view(-1, cfg.vocab_size), ids.view(-1))
    assert out.logits.dtype == torch.float32
    assert (out.logits - logits).abs().max().item() <= 1e-5
    assert abs(out.loss.item() - loss.item()) <= 1e-6


def test_initialisation_matches_reference_scheme():
    cfg = small_config(d_model=128, n_heads=4)
    model = build_model(cfg, seed=3)
    sigma = math.sqrt(2 / (5 * 128))
    inj = model.injection
    a_bar, delta = inj.discretised()
    assert torch.allclose(a_bar, torch.full_like(a_bar, 1 / math.sqrt(5)), atol=1e-6)
    assert torch.allclose(delta, torch.full_like(delta, 0.5 * math.log(5)), atol=1e-6)
    assert torch.equal(inj.B, torch.eye(128))
    assert torch.all(model.core[0].attn.proj.weight == 0) and torch.all(model.core[0].mlp.proj.weight == 0)
    sv = torch.linalg.svdvals(model.C.weight)
    assert torch.allclose(sv, torch.full_like(sv, math.sqrt(2 / 5)), atol=1e-5)
    q = model.core[0].attn.q.weight
    assert abs(q.std().item() - sigma) / sigma < 0.05
    assert abs(model.value_embeds["1"].weight.std().item() - 1.0) < 0.05
    again = build_model(cfg, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


def test_converter_round_trip_is_bit_exact():
    cfg, model, _ = _model_and_inputs()
    ref = to_reference_state_dict(model.state_dict(), cfg)
    ref = {("_orig_mod." + k if i % 2 else k): v.clone() for i, (k, v) in enumerate(ref.items())}
    ref["freqs_cis"] = torch.zeros(1)
    ours = from_reference_state_dict(ref, cfg)
    back = to_reference_state_dict(ours, cfg)
    stripped = {k.replace("_orig_mod.", ""): v for k, v in ref.items() if k != "freqs_cis"}
    assert set(back) == set(stripped)
    for key in back:
        assert torch.equal(back[key], stripped[key]), key
    fresh = build_model(cfg)
    fresh.load_state_dict(ours, strict=True)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))


@pytest.mark.parametrize("mutate,needle", [
    (lambda sd: sd.update({"transformer.core_block.0.attn.c_qq.weight": torch.zeros(1)}), "c_qq"),
    (lambda sd: sd.pop("transformer.coda.0.mlp.fc.weight"), "transformer.coda.0.mlp.fc.weight"),
    (lambda sd: sd.update({"transformer.adapter.B": torch.zeros(3, 3)}), "transformer.adapter.B"),
    (lambda sd: sd.update({"value_embeds.2.weight": torch.zeros(256, 64)}), "value_embeds.2.weight"),
])
def test_converter_refuses_wrong_keys_and_shapes(mutate, needle):
    cfg, model, _ = _model_and_inputs()
    ref = to_reference_state_dict(model.state_dict(), cfg)
    mutate(ref)
    with pytest.raises(ConversionError) as info:
        from_reference_state_dict(ref, cfg)
    assert needle in str(info.value)
