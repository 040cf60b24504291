"""Muon's whole step against a float64 reference written here from the formulas of PARCAE_REFERENCE.md section 7.

Tolerances: with the Polar Express run in float64 (orth_dtype=torch.float64) the step must equal the reference to
1e-12 (every other operation is float64 too); with the default bf16 iterations the parameter change must match to
a relative Frobenius error of 0.08 (weight decay 0 there, see the test), the bf16 tolerance of the orthogonalisation test, since
the orthogonalisation dominates it.
"""

import math

import pytest
import torch

from megaloop.optim import MuonHParams, apply_muon_update, init_muon_state, muon_update
from megaloop.optim.muon import Muon

COEFFS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]


def ref_orthogonalise(u):
    x = u / (1.02 * torch.linalg.matrix_norm(u) + 1e-6)
    for a, b, c in COEFFS:
        gram = x.T @ x
        x = a * x + b * (x @ gram) + c * (x @ gram @ gram)
    return x


def ref_muon_step(p, g, state, momentum, lr, wd, beta2=0.95, nesterov=True):
    """One float64 Muon step; returns the new parameter and state (inputs untouched)."""
    rows, cols = p.shape
    m = momentum * state["m"] + (1 - momentum) * g
    u = (1 - momentum) * g + momentum * m if nesterov else m
    o = ref_orthogonalise(u)
    per_row = rows >= cols
    row_or_col_mean_sq = (o**2).mean(dim=1, keepdim=True) if per_row else (o**2).mean(dim=0, keepdim=True)
    v = beta2 * state["v"] + (1 - beta2) * row_or_col_mean_sq
    n = o / torch.sqrt(torch.clamp(v, min=1e-10))
    n = n * torch.linalg.matrix_norm(o) / torch.linalg.matrix_norm(n)
    lr_eff = lr * math.sqrt(max(1.0, rows / cols))
    mask = (n * p >= 0).double()
    new_p = p - lr_eff * (n + wd * p * mask)
    return new_p, {"m": m, "v": v}, mask


# (momentum, lr, weight decay) for three consecutive steps: exercises the warm-up-like change of momentum and the
# schedules changing lr and weight decay between steps.
STEPS = [(0.85, 0.02, 0.2), (0.88, 0.02, 0.15), (0.95, 0.01, 0.1)]
SHAPES = [(48, 16), (16, 48), (24, 24)]


def run_both(shape, nesterov, orth_dtype, param_dtype, steps=STEPS):
    gen = torch.Generator().manual_seed(sum(shape))
    p0 = 0.5 * torch.randn(shape, generator=gen, dtype=torch.float64)
    grads = [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in steps]
    param = torch.nn.Parameter(p0.to(param_dtype).clone())
    opt = Muon([param], beta2=0.95, nesterov=nesterov, orth_dtype=orth_dtype)
    ref_p = param.detach().double().clone()
    rows, cols = shape
    ref_state = {"m": torch.zeros(shape, dtype=torch.float64),
                 "v": torch.zeros((rows, 1) if rows >= cols else (1, cols), dtype=torch.float64)}
    history = []
    for (momentum, lr, wd), g in zip(steps, grads):
        before = param.detach().double().clone()
        param.grad = g.to(param_dtype)
        opt.param_groups[0].update(lr=lr, momentum=momentum, weight_decay=wd)
        opt.step()
        ref_before = ref_p
        ref_p, ref_state, mask = ref_muon_step(ref_p, g, ref_state, momentum, lr, wd, nesterov=nesterov)
        history.append((param.detach().double() - before, ref_p - ref_before, mask))
    return param, opt.state[param], ref_p, ref_state, history


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_float64_muon_step_equals_reference(shape, nesterov):
    param, state, ref_p, ref_state, history = run_both(shape, nesterov, torch.float64, torch.float64)
    err_p = (param.detach() - ref_p).abs().max().item()
    err_m = (state["momentum_buffer"] - ref_state["m"]).abs().max().item()
    err_v = ((state["second_moment"] - ref_state["v"]).abs().max() / ref_state["v"].abs().max()).item()
    print(f"muon float64 {shape} nesterov={nesterov}: max|dp| {err_p:.2e}, max|dm| {err_m:.2e}, rel dv {err_v:.2e}")
    assert state["second_moment"].shape == ref_state["v"].shape
    assert err_p <= 1e-12 and err_m <= 1e-12 and err_v <= 1e-12
    masks = torch.stack([mask for _, _, mask in history])
    assert 0.1 < masks.mean().item() < 0.9, "the test must exercise both sides of the cautious mask"


@pytest.mark.parametrize("shape", [(256, 64), (64, 256), (128, 128)])
def test_bf16_muon_step_matches_reference(shape):
    # Weight decay 0 here: with bf16 noise a few elements with update * p ~ 0 flip the cautious mask and move by
    # lr * wd * p, which says nothing about precision; the mask itself is pinned by the float64 test above.
    steps = [(momentum, lr, 0.0) for momentum, lr, _ in STEPS]
    _, _, _, _, history = run_both(shape, True, torch.bfloat16, torch.float32, steps=steps)
    for index, (ours, ref, _) in enumerate(history):
        rel = (torch.linalg.matrix_norm(ours - ref) / torch.linalg.matrix_norm(ref)).item()
        print(f"muon bf16 {shape} step {index}: relative Frobenius error of the parameter change {rel:.4f}")
        assert rel <= 0.08


def test_shape_factor_and_state_shapes():
    tall = init_muon_state(torch.zeros(64, 16))
    wide = init_muon_state(torch.zeros(16, 64))
    assert tall["second_moment"].shape == (64, 1) and wide["second_moment"].shape == (1, 64)
    g = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))
    update = muon_update(g, tall, MuonHParams(momentum=0.9))
    # NorMuon keeps the Frobenius norm of the orthogonalised matrix: sqrt(16) singular values near 1.
    assert 0.85 * 4 <= torch.linalg.matrix_norm(update).item() <= 1.15 * 4
    p = torch.zeros(64, 16)
    apply_muon_update(p, update, lr=0.01 * 2.0, weight_decay=0.0)  # sqrt(64/16) = 2
    torch.testing.assert_close(p, -0.02 * update, rtol=0, atol=0)


def test_update_applies_to_shards_like_the_whole():
    gen = torch.Generator().manual_seed(1)
    p = torch.randn(32, 8, generator=gen)
    update = torch.randn(32, 8, generator=gen)
    whole = p.clone()
    apply_muon_update(whole, update, lr=0.03, weight_decay=0.2)
    halves = [p[:16].clone(), p[16:].clone()]
    for half, u in zip(halves, (update[:16], update[16:])):
        apply_muon_update(half, u, lr=0.03, weight_decay=0.2)
    assert torch.equal(torch.cat(halves), whole)


def test_bf16_parameters_keep_fp32_state():
    param = torch.nn.Parameter(torch.randn(16, 8).bfloat16())
    param.grad = torch.randn(16, 8).bfloat16()
    opt = Muon([param], lr=0.01, momentum=0.9)
    before = param.detach().clone()
    opt.step()
    assert opt.state[param]["momentum_buffer"].dtype == torch.float32
    assert param.dtype == torch.bfloat16 and not torch.equal(param.detach(), before)


def test_rejects_non_matrices_and_skips_missing_grads():
    with pytest.raises(ValueError, match="2-D weight matrices only.*shape \\(2, 3, 4\\)"):
        Muon([torch.nn.Parameter(torch.zeros(2, 3, 4))])
    with pytest.raises(ValueError, match="2-D"):
        init_muon_state(torch.zeros(5))
    param = torch.nn.Parameter(torch.ones(4, 4))
    opt = Muon([param])
    opt.step()
    assert torch.equal(param.detach(), torch.ones(4, 4)) and len(opt.state) == 0
