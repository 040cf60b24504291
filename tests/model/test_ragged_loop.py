"""The ragged loop (fp64, 1e-12): with per-sequence depths every sequence's logits, loss and gradient equal a solo
run of that sequence at its own depth, with and without truncated backprop, for Parcae (diagonal) and RDM (concat);
the core passes executed (counted by a hook on the first core block) equal the sum of the depths; the forward and
backward read no device scalar (aten._local_scalar_dense); the masked loop gives the same numbers."""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megaloop.model import build_model
from megaloop.model.depth_plan import DepthPlan, RaggedPlan
from tests.model.helpers import rand_like_params_, small_config

TOL = 1e-12
DEPTHS = np.array([3, 1, 6, 2, 6, 4])  # unsorted, with a tie and a depth-1 row
RDM = dict(arch="rdm", injection="concat", block="sandwich", use_C=False)


def _setup(arch: str, seed: int = 0):
    cfg = small_config(mu_rec=4, **(RDM if arch == "rdm" else {}))
    model = build_model(cfg).double()
    rand_like_params_(model, seed=seed)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (len(DEPTHS), cfg.seq_len), generator=g)
    h0 = 0.3 * torch.randn(len(DEPTHS), cfg.seq_len, cfg.d_model, generator=g, dtype=torch.float64)
    return cfg, model, ids, h0


class _CoreRowCounter:
    """Rows passed through the first core block (= rows x laps through the core), counted by a forward hook."""

    def __init__(self, model):
        self.rows = 0
        self.handle = model.core[0].register_forward_hook(self._hook)

    def _hook(self, _module, args, _out):
        self.rows += args[0].shape[0]


def _grads(model):
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def _max_rel_diff(a: dict, b: dict) -> float:
    return max(((a[n] - b[n]).abs().max() / max(b[n].abs().max().item(), 1.0)).item() for n in a)


def _written_out(model, ids, h0, t: int, k: int):
    """One sequence's loop written out with the model's seams: t - k laps without gradient, then k with."""
    ctx = model.context(ids)
    e, h = model.encode(ids, ctx), h0
    for lap in range(t):
        with torch.set_grad_enabled(lap >= t - k):
            h = model.loop_step(h, e, ctx)
    logits = model.logits(model.decode(h, ctx))
    return logits, F.cross_entropy(logits.view(-1, logits.shape[-1]), ids.reshape(-1))


def _solo(model, ids, h0, depths, backprop):
    """Each sequence alone at its own depth: logits, loss, and the gradient of mean over sequences of losses."""
    model.zero_grad(set_to_none=True)
    logits, losses = [], []
    for i, t in enumerate(depths.tolist()):
        k = t if backprop is None else min(t, int(backprop if np.ndim(backprop) == 0 else backprop[i]))
        lg, loss = _written_out(model, ids[i:i + 1], h0[i:i + 1], t, k)
        (loss / len(depths)).backward()
        logits.append(lg.detach())
        losses.append(loss.detach())
    return torch.cat(logits), torch.stack(losses), _grads(model)


def _batched(model, ids, h0, depths, backprop):
    model.zero_grad(set_to_none=True)
    counter = _CoreRowCounter(model)
    out = model(ids, labels=ids, depth=depths, backprop_depth=backprop, h0=h0)
    counter.handle.remove()
    out.loss.backward()  # equal sequence lengths: the batch mean equals the mean of per-sequence losses
    per_seq = F.cross_entropy(out.logits.transpose(1, 2), ids, reduction="none").mean(1)
    return out, counter.rows, out.logits.detach(), per_seq.detach(), _grads(model)


@pytest.mark.parametrize("arch", ["parcae", "rdm"])
@pytest.mark.parametrize("truncated", [False, True])
def test_ragged_equals_each_sequence_alone(arch, truncated):
    cfg, model, ids, h0 = _setup(arch)
    mu_bwd = math.ceil(cfg.mu_rec / 2)
    backprop = np.minimum(DEPTHS, mu_bwd) if truncated else None  # the trainer's per-sequence k_i = min(T_i, K)
    out, rows, logits, per_seq, grads = _batched(model, ids, h0, torch.from_numpy(DEPTHS), backprop)
    ref_logits, ref_losses, ref_grads = _solo(model, ids, h0, DEPTHS, backprop)
    err_logits = (logits - ref_logits).abs().max().item()
    err_loss = (per_seq - ref_losses).abs().max().item()
    err_grad = _max_rel_diff(grads, ref_grads)
    print(f"{arch} truncated={truncated}: logits {err_logits:.1e} losses {err_loss:.1e} grads {err_grad:.1e}; "
          f"core rows {rows} (sum T {DEPTHS.sum()}, masked would run {out.telemetry['executed_steps'] * 6})")
    assert rows == out.telemetry["core_rows"] == DEPTHS.sum()
    assert out.telemetry["executed_steps"] == DEPTHS.max() and out.telemetry["useful_steps"] == DEPTHS.sum()
    assert err_logits <= TOL and err_loss <= TOL and err_grad <= TOL
    assert grads["injection." + ("A_log" if arch == "parcae" else "W.weight")].abs().sum() > 0


def test_non_aligned_backprop_depth_uses_masked_loop_and_equals_alone():
    """k_i not of the form min(T_i, K): the masked loop runs (max n + max k laps for every row), still exact."""
    cfg, model, ids, h0 = _setup("parcae", seed=1)
    backprop = np.array([1, 1, 4, 2, 2, 3])
    out, rows, logits, _, grads = _batched(model, ids, h0, DEPTHS.tolist(), backprop)
    ref_logits, _, ref_grads = _solo(model, ids, h0, DEPTHS, backprop)
    plan = DepthPlan.make(DEPTHS, backprop, len(DEPTHS))
    assert not plan.end_aligned
    assert rows == (plan.nograd_steps + plan.grad_steps) * len(DEPTHS) == out.telemetry["core_rows"]
    assert (logits - ref_logits).abs().max().item() <= TOL and _max_rel_diff(grads, ref_grads) <= TOL


def test_masked_loop_gives_the_same_numbers():
    cfg, model, ids, h0 = _setup("parcae", seed=2)
    ragged = _batched(model, ids, h0, DEPTHS, 2)
    model.ragged_loop = False
    masked = _batched(model, ids, h0, DEPTHS, 2)
    assert masked[1] == (DEPTHS.max()) * len(DEPTHS) > ragged[1] == DEPTHS.sum()
    assert (ragged[2] - masked[2]).abs().max().item() <= TOL and _max_rel_diff(ragged[4], masked[4]) <= TOL
    for key in ("state_norm", "recurrent_residual"):
        assert abs((ragged[0].telemetry[key] - masked[0].telemetry[key]).item()) <= TOL


def test_ragged_plan_prefixes_and_boundary():
    plan = RaggedPlan.make(DepthPlan.make(DEPTHS, 2, len(DEPTHS)))
    assert plan.order.tolist() == [2, 4, 5, 0, 3, 1]
    # sorted depths 6 6 4 3 2 1, end-aligned over 6 laps: lap t runs the rows with T >= 6 - t
    assert plan.prefix == (2, 2, 3, 4, 5, 6) and plan.core_rows == DEPTHS.sum()
    assert plan.boundary == 4


def test_forward_backward_reads_no_device_scalar():
    """Depths as numpy, list and CPU tensor: planning uses host integers only; telemetry stays tensors."""

    class ScalarReads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                ScalarReads.count += 1
            return func(*args, **(kwargs or {}))

    cfg, model, ids, h0 = _setup("parcae")
    for depth in (DEPTHS, DEPTHS.tolist(), torch.from_numpy(DEPTHS)):
        with ScalarReads():
            out = model(ids, labels=ids, depth=depth, backprop_depth=np.minimum(DEPTHS, 2), h0=h0)
            out.loss.backward()
        assert ScalarReads.count == 0
        assert all(torch.is_tensor(out.telemetry[k]) and out.telemetry[k].dim() == 0 and
                   not out.telemetry[k].requires_grad for k in ("state_norm", "recurrent_residual", "rho_A"))
        assert all(type(out.telemetry[k]) is int for k in ("executed_steps", "useful_steps", "core_rows"))


def test_device_depths_are_refused_with_advice():
    cfg, model, ids, _ = _setup("parcae")
    with pytest.raises(TypeError, match="must be an int or 6 integer per-sequence values"):
        model(ids, depth=np.array([1.5] * 6))
    with pytest.raises(TypeError, match="pass host depths"):
        model(ids, depth=torch.ones(6, dtype=torch.long, device="meta"))
