"""Activation checkpointing (block, lap) gives the gradients of "none" in fp64 (1e-12) and really recomputes in
backward (the core block runs again during backward); torch.compile of the blocks matches eager in fp32 (1e-5) with
per-sequence depths."""
import numpy as np
import pytest
import torch

from megaloop.model import build_model
from tests.model.helpers import rand_like_params_, small_config

DEPTHS = np.array([3, 1, 5, 2])
RDM = dict(arch="rdm", injection="concat", block="sandwich", use_C=False)
GPT = dict(arch="gpt", injection="none", mu_rec=1, mu_bwd=None, prelude_norm=False, use_C=False)


def _setup(dtype=torch.float64, **overrides):
    cfg = small_config(**overrides)
    model = build_model(cfg).to(dtype)
    rand_like_params_(model, seed=4)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, cfg.vocab_size, (len(DEPTHS), cfg.seq_len), generator=g)
    h0 = (0.3 * torch.randn(len(DEPTHS), cfg.seq_len, cfg.d_model, generator=g)).to(dtype)
    return cfg, model, ids, h0


def _step(model, ids, h0, depth, backprop):
    """Loss, gradients, and how often the first core block ran during backward (recomputation)."""
    model.zero_grad(set_to_none=True)
    calls = {"forward": 0, "total": 0}
    # a pre-hook: recomputation stops early once the saved tensors are rebuilt, before any post-hook
    handle = model.core[0].register_forward_pre_hook(lambda *_: calls.__setitem__("total", calls["total"] + 1))
    out = model(ids, labels=ids, depth=depth, backprop_depth=backprop, h0=h0)
    calls["forward"] = calls["total"]
    out.loss.backward()
    handle.remove()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads, calls["total"] - calls["forward"]


@pytest.mark.parametrize("arch,depth,backprop", [("parcae", DEPTHS, 2), ("parcae", DEPTHS, None),
                                                 ("rdm", DEPTHS, 2), ("gpt", 1, None)])
def test_checkpointing_gradients_equal_none(arch, depth, backprop):
    cfg, model, ids, h0 = _setup(**{"rdm": RDM, "gpt": GPT}.get(arch, {}))
    loss, ref, recomputed = _step(model, ids, h0, depth, backprop)
    assert recomputed == 0
    grad_laps = 1 if arch == "gpt" else int(np.minimum(DEPTHS, backprop or 99).max())
    for mode in ("block", "lap"):
        model.set_activation_checkpointing(mode)
        loss_m, grads, recomputed = _step(model, ids, h0, depth, backprop)
        err = max(((grads[n] - ref[n]).abs().max() / max(ref[n].abs().max().item(), 1.0)).item() for n in ref)
        print(f"{arch} backprop={backprop} {mode}: grad max rel diff {err:.1e}, core block re-run {recomputed}x")
        assert grads.keys() == ref.keys() and err <= 1e-12 and abs((loss_m - loss).item()) <= 1e-12
        assert recomputed == grad_laps, "each gradient lap's core block must run again in backward"


def test_unknown_checkpointing_mode_is_refused():
    _, model, _, _ = _setup()
    with pytest.raises(ValueError, match="train.activation_checkpointing"):
        model.set_activation_checkpointing("layer")


@pytest.mark.slow  # CPU inductor compiles several block graphs (about a minute of CPU)
def test_compiled_blocks_equal_eager_fp32():
    torch._dynamo.reset()
    cfg, model, ids, h0 = _setup(torch.float32)
    ref_loss, ref, _ = _step(model, ids, h0, DEPTHS, 2)
    model.set_compile(True)
    loss, grads, _ = _step(model, ids, h0, DEPTHS, 2)
    err = max(((grads[n] - ref[n]).abs().max() / max(ref[n].abs().max().item(), 1.0)).item() for n in ref)
    print(f"compiled vs eager (fp32): loss {abs((loss - ref_loss).item()):.1e}, grads max rel {err:.1e}")
    assert abs((loss - ref_loss).item()) <= 1e-5 and err <= 1e-5
    assert all(getattr(b, "_compiled_call_impl", None) is not None for b in [*model.prelude, *model.core])


def test_variable_depths_do_not_recompile():
    """Fresh per-sequence depths at every step (active prefixes of every size): after the first step's graphs, at
    most 2 more over 8 steps. Dynamo's own graph count; the "eager" backend keeps the test fast (the inductor
    figures are in benchmarks/compile_loop.py)."""
    from torch._dynamo.utils import counters

    from megaloop.depth import make_sampler

    torch._dynamo.reset()
    cfg, model, _, _ = _setup(torch.float32, mu_rec=8, mu_bwd=4)
    model.set_compile(True, backend="eager")
    sampler = make_sampler("poisson-truncated-full", 8, 4, seed=0)
    g = torch.Generator().manual_seed(0)
    graphs = []
    for step in range(8):
        depth = sampler.sample(step, np.arange(6 * step, 6 * step + 6))
        ids = torch.randint(0, cfg.vocab_size, (6, cfg.seq_len), generator=g)
        before = counters["stats"]["unique_graphs"]
        model(ids, labels=ids, depth=depth.T.numpy(), backprop_depth=depth.k.numpy()).loss.backward()
        graphs.append(counters["stats"]["unique_graphs"] - before)
    print(f"graphs compiled per step: {graphs}")
    assert graphs[0] > 0, "the blocks must be compiled"
    assert sum(graphs[1:]) <= 2
