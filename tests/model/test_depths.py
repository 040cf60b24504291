"""With mixed per-sequence depths each sequence equals running it alone at its own depth (1e-5, fp32),
with and without truncated backprop; gradients with backprop_depth=k equal a reference that detaches the state
before the last k steps."""
import pytest
import torch

from megaloop.model import build_model
from tests.model.helpers import rand_like_params_, small_config

TOL = 1e-5


def _setup(seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = small_config(**overrides)
    model = build_model(cfg)
    rand_like_params_(model, seed=seed)
    ids = torch.randint(0, cfg.vocab_size, (4, cfg.seq_len))
    h0 = 0.3 * torch.randn(4, cfg.seq_len, cfg.d_model)
    return cfg, model, ids, h0


@pytest.mark.parametrize("backprop_depth", [None, 2])
@pytest.mark.parametrize("arch", ["parcae", "rdm"])
def test_mixed_depths_equal_each_sequence_alone(backprop_depth, arch):
    extra = dict(arch="rdm", injection="concat", block="sandwich", use_C=False) if arch == "rdm" else {}
    cfg, model, ids, h0 = _setup(**extra)
    depths = torch.tensor([1, 5, 3, 2])
    out = model(ids, labels=ids, depth=depths, backprop_depth=backprop_depth, h0=h0)
    per_seq = torch.nn.functional.cross_entropy(out.logits.transpose(1, 2), ids, reduction="none").mean(1)
    for i, t in enumerate(depths.tolist()):
        alone = model(ids[i:i + 1], labels=ids[i:i + 1], depth=t, backprop_depth=backprop_depth, h0=h0[i:i + 1])
        assert (out.logits[i] - alone.logits[0]).abs().max().item() <= TOL
        assert abs(per_seq[i].item() - alone.loss.item()) <= TOL
    assert out.telemetry["executed_steps"] == (5 if backprop_depth is None else 3 + 2)
    assert out.telemetry["useful_steps"] == 11


def _reference_truncated_loss(model, ids, h0, depth, k):
    """The loop written out: detach the state before the last k steps (no masking, one sequence)."""
    ctx = model.context(ids)
    e = model.encode(ids, ctx)
    h = h0
    for t in range(depth):
        if t == depth - k:
            h = h.detach()
        h = model.loop_step(h, e if t >= depth - k else e.detach(), ctx)
    logits = model.logits(model.decode(h, ctx))
    return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), ids.view(-1))


def _grads(model):
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


@pytest.mark.parametrize("depth,k", [(5, 2), (4, 4), (3, 1)])
def test_truncated_backprop_gradients_equal_detach_reference(depth, k):
    cfg, model, ids, h0 = _setup(seed=2)
    ids, h0 = ids[:2], h0[:2]
    model.zero_grad()
    model(ids, labels=ids, depth=depth, backprop_depth=k, h0=h0).loss.backward()
    ours = _grads(model)
    model.zero_grad()
    _reference_truncated_loss(model, ids, h0, depth, k).backward()
    ref = _grads(model)
    for name in ours:
        scale = max(ref[name].abs().max().item(), 1e-3)
        assert (ours[name] - ref[name]).abs().max().item() <= TOL * scale, name
    assert ours["injection.A_log"].abs().sum() > 0, "the injection must get gradient through the grad steps"


def test_mixed_depth_gradients_equal_sum_of_single_sequence_gradients():
    cfg, model, ids, h0 = _setup(seed=3)
    depths, k = torch.tensor([1, 4, 6, 2]), 2
    model.zero_grad()
    out = model(ids, labels=ids, depth=depths, backprop_depth=k, h0=h0)
    # mean over sequences of per-sequence mean losses == the batch mean (equal lengths)
    out.loss.backward()
    batch_grads = _grads(model)
    total = {n: torch.zeros_like(g) for n, g in batch_grads.items()}
    for i, t in enumerate(depths.tolist()):
        model.zero_grad()
        (model(ids[i:i + 1], labels=ids[i:i + 1], depth=t, backprop_depth=k, h0=h0[i:i + 1]).loss / 4).backward()
        for n, g in _grads(model).items():
            total[n] += g
    for name in total:
        scale = max(total[name].abs().max().item(), 1e-3)
        assert (batch_grads[name] - total[name]).abs().max().item() <= TOL * scale, name


def test_default_h0_is_keyed_by_sample_index_not_batch_position():
    cfg, model, ids, _ = _setup()
    key = (7, 11, torch.tensor([40, 41, 42, 43]))
    full = model(ids, depth=3, noise_key=key)
    sub = model(ids[2:3], depth=3, noise_key=(7, 11, torch.tensor([42])))
    assert (full.logits[2] - sub.logits[0]).abs().max().item() <= TOL
    other_step = model(ids[2:3], depth=3, noise_key=(7, 12, torch.tensor([42])))
    assert (other_step.logits[0] - sub.logits[0]).abs().max().item() > 1e-6


def test_invalid_depths_are_rejected():
    cfg, model, ids, _ = _setup()
    with pytest.raises(ValueError, match="depth must be >= 1"):
        model(ids, depth=torch.tensor([1, 0, 2, 3]))
    with pytest.raises(TypeError, match="per-sequence"):
        model(ids, depth=torch.tensor([1, 2]))
    gpt = build_model(small_config(arch="gpt", injection="none", mu_rec=1, mu_bwd=None, prelude_norm=False,
                                   use_C=False))
    with pytest.raises(ValueError, match="runs its blocks once"):
        gpt(ids, depth=3)
