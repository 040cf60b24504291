"""The combined optimizer: AdamW groups against plain torch AdamW, clipping, non-finite skipping and
state-dict round trips."""

import copy
import dataclasses
import io
import math

import pytest
import torch

from megaloop.optim import OptimConfig, build_optimizer, clip_grads

SHAPES = {
    "embed.weight": (40, 16),
    "core.0.norm_1.weight": (16,),
    "core.0.attn.q.weight": (16, 16),
    "core.0.attn.ve_gate.weight": (2, 32),
    "core.0.mlp.fc.weight": (64, 16),
    "core.0.mlp.proj.weight": (16, 64),
    "injection.A_log": (16,),
    "injection.B": (16, 16),
    "C.weight": (16, 16),
    "final_norm.weight": (16,),
}
ADAMW_NAMES = ["embed.weight", "core.0.norm_1.weight", "injection.A_log", "injection.B", "C.weight",
               "final_norm.weight"]
TOTAL_STEPS = 6
# Trapezoid multipliers for 6 steps, cool-down over the last 3 (floor(0.5 * 6)), computed by hand:
# constant through step 3, then (6 - step) / 3.
HAND_MULTIPLIERS = [1.0, 1.0, 1.0, 1.0, 2 / 3, 1 / 3]


def make_params(seed=0, dtype=torch.float32):
    """Parameters at an init-like scale (std 0.1), where fp32's resolution is ~1e-8, so that the 1e-7 tolerance of
    the difference is a few ulps (at |p| ~ 3 a single ulp is 2.4e-7)."""
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.nn.Parameter(0.1 * torch.randn(shape, generator=gen, dtype=dtype))
            for name, shape in SHAPES.items()}


def make_grads(step, scale=3.0):
    gen = torch.Generator().manual_seed(1000 + step)
    return {name: scale * torch.randn(shape, generator=gen) for name, shape in SHAPES.items()}


def set_grads(params, grads):
    for name, param in params.items():
        param.grad = grads[name].to(param.dtype).clone()


@pytest.mark.parametrize("mode", ["muon", "adamw"])
def test_adamw_groups_equal_plain_torch_adamw(mode):
    """our AdamW groups (fused torch AdamW driven by our schedule and clipping) equal a plain for-loop torch
    AdamW given the hand-computed lr and torch's own clip_grad_norm_, to 1e-7 absolute, over 6 steps."""
    params = make_params()
    ref_params = {name: torch.nn.Parameter(p.detach().clone()) for name, p in params.items()}
    opt = build_optimizer(params.items(), OptimConfig(name=mode), TOTAL_STEPS)
    adamw_names = ADAMW_NAMES if mode == "muon" else list(SHAPES)
    ref = torch.optim.AdamW([ref_params[n] for n in adamw_names], lr=8e-3, betas=(0.8, 0.95), eps=1e-10,
                            weight_decay=0.0, foreach=False, fused=False)
    for step in range(TOTAL_STEPS):
        grads = make_grads(step)
        set_grads(params, grads)
        set_grads(ref_params, grads)
        record = opt.step()
        ref_norm = torch.nn.utils.clip_grad_norm_(list(ref_params.values()), 1.0)
        for group in ref.param_groups:
            group["lr"] = 8e-3 * HAND_MULTIPLIERS[step]
        ref.step()
        err = max((params[n].detach() - ref_params[n].detach()).abs().max().item() for n in adamw_names)
        print(f"adamw groups {mode} step {step}: lr {record.adam_lr:.6f} grad_norm {record.grad_norm:.4f} "
              f"(torch {ref_norm.item():.4f}) max|ours - torch AdamW| {err:.2e} (tol 1e-7)")
        assert record.adam_lr == pytest.approx(8e-3 * HAND_MULTIPLIERS[step], rel=1e-12)
        assert record.grad_norm == pytest.approx(ref_norm.item(), rel=1e-6)
        assert err <= 1e-7
    moved = max((params[n].detach() - make_params()[n].detach()).abs().max().item() for n in adamw_names)
    assert moved > 1e-3  # the comparison is not vacuous


def test_clip_grads_matches_torch_and_takes_a_reduced_norm():
    params = make_params()
    grads = make_grads(0)
    set_grads(params, grads)
    ours = clip_grads(params.values(), 1.0)
    theirs_params = make_params()
    set_grads(theirs_params, grads)
    theirs = torch.nn.utils.clip_grad_norm_(list(theirs_params.values()), 1.0).item()
    assert ours == pytest.approx(theirs, rel=1e-6) and ours > 1.0
    for name in SHAPES:
        torch.testing.assert_close(params[name].grad, theirs_params[name].grad, rtol=1e-6, atol=1e-9)
    # A "distributed" reduction that doubles the local sum of squares (two identical shards): norm * sqrt(2).
    set_grads(params, grads)
    doubled = clip_grads(params.values(), 0.0, norm_sq_reduce=lambda sq: sq * 2)
    assert doubled == pytest.approx(theirs * math.sqrt(2), rel=1e-6)
    assert all(torch.equal(params[n].grad, grads[n]) for n in SHAPES)  # max_norm 0: measured, not clipped
    grads["C.weight"][0, 0] = float("inf")
    set_grads(params, grads)
    assert clip_grads(params.values(), 1.0) == float("inf")
    assert all(torch.equal(params[n].grad, grads[n]) for n in SHAPES)  # untouched when not finite


def snapshot(params, opt):
    state = copy.deepcopy(opt.state_dict())
    return {n: p.detach().clone() for n, p in params.items()}, state


def assert_same_tree(a, b, path="state"):
    """Bitwise equality of nested dicts/lists of tensors and numbers."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for key in a:
            assert_same_tree(a[key], b[key], f"{path}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{path}[{i}]")
    else:
        assert a == b, path


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_step_is_skipped_bit_identically(bad):
    params = make_params()
    opt = build_optimizer(params.items(), OptimConfig(), TOTAL_STEPS)
    for step in range(2):
        set_grads(params, make_grads(step))
        opt.step()
    before_params, before_state = snapshot(params, opt)
    grads = make_grads(2)
    grads["core.0.mlp.fc.weight"][3, 5] = bad
    set_grads(params, grads)
    record = opt.step()
    assert record.skipped and not math.isfinite(record.grad_norm) and record.step == 2
    assert opt.num_skipped == 1 and opt.iteration == 3
    assert all(p.grad is None for p in params.values())
    for name, param in params.items():
        assert torch.equal(param.detach(), before_params[name]), name
    after_state = opt.state_dict()
    for key in ("muon", "adamw"):
        assert_same_tree(before_state[key], after_state[key], key)
    set_grads(params, make_grads(3))
    assert not opt.step().skipped  # training continues


def run_steps(params, opt, steps):
    for step in steps:
        set_grads(params, make_grads(step))
        opt.step()
        opt.zero_grad()


def test_state_dict_round_trip_continues_identically():
    params = make_params()
    opt = build_optimizer(params.items(), OptimConfig(), TOTAL_STEPS)
    run_steps(params, opt, range(3))
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)  # plain tensors, numbers and strings only
    resumed_params = {n: torch.nn.Parameter(p.detach().clone()) for n, p in params.items()}
    resumed = build_optimizer(resumed_params.items(), OptimConfig(), TOTAL_STEPS)
    resumed.load_state_dict(saved)
    assert resumed.iteration == 3
    run_steps(params, opt, range(3, 6))
    run_steps(resumed_params, resumed, range(3, 6))
    for name in SHAPES:
        assert torch.equal(params[name].detach(), resumed_params[name].detach()), name
    assert_same_tree(opt.state_dict(), resumed.state_dict())


def test_state_dict_refuses_other_parameters():
    params = make_params()
    opt = build_optimizer(params.items(), OptimConfig(), TOTAL_STEPS)
    state = opt.state_dict()
    renamed = {("x." + n if n == "C.weight" else n): p for n, p in params.items()}
    other = build_optimizer(renamed.items(), OptimConfig(), TOTAL_STEPS)
    with pytest.raises(ValueError, match="saved for other parameters"):
        other.load_state_dict(state)


def test_step_record_and_explicit_step():
    params = make_params()
    opt = build_optimizer(params.items(), OptimConfig(), 1000)
    set_grads(params, make_grads(0))
    record = opt.step(750)
    assert (record.step, record.skipped, opt.iteration) == (750, False, 751)
    assert record.lr_multiplier == pytest.approx(0.5) and record.matrix_lr == pytest.approx(4e-3)
    assert record.muon_momentum == pytest.approx(0.95) and record.muon_weight_decay == pytest.approx(0.05)
    assert opt.muon.param_groups[0]["weight_decay"] == pytest.approx(0.05)


def test_build_checks_config_and_run_length():
    with pytest.raises(ValueError, match="optim.matrix_lr"):
        build_optimizer(make_params().items(), dataclasses.replace(OptimConfig(), matrix_lr=-1.0), 10)
    with pytest.raises(ValueError, match="overlaps the cool-down"):
        build_optimizer(make_params().items(), OptimConfig(warmup_steps=8), 10)
