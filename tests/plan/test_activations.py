"""The activation formulas against the model itself: the bytes autograd saves (saved-tensor hooks, each storage
once, parameters excluded) and the peak of live tensor bytes during forward + backward (the allocator's records),
for every checkpointing setting, in fp32 and under bf16 autocast."""
import contextlib

import pytest
import torch

from megaloop.config import load_config
from megaloop.model import build_model
from megaloop.plan.activations import Sizes, activation_terms
from megaloop.plan.layout import local_params
from megaloop.plan.measure import live_tensor_peak

SMALL = ["model.vocab_size=512", "model.d_model=96", "model.n_heads=4", "model.n_prelude=1", "model.n_core=2",
         "model.n_coda=1", "model.seq_len=40", "model.mu_rec=3", "model.mu_bwd=2"]
B = 3


def _setup(precision: str, checkpointing: str, extra=()):
    cfg = load_config(None, [*SMALL, f"train.precision={precision}", *extra])
    model = build_model(cfg.model)
    model.set_activation_checkpointing(checkpointing)
    ids = torch.randint(0, cfg.model.vocab_size, (B, cfg.model.seq_len), generator=torch.Generator().manual_seed(0))
    return cfg, model, ids


def _autocast(precision: str):
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()


def _saved_bytes(model, ids, precision: str) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _autocast(precision):
        model(ids, labels=ids, depth=3, backprop_depth=2)
    return sum(seen.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("checkpointing", ["none", "block", "lap"])
def test_saved_bytes_match_formula(precision, checkpointing):
    cfg, model, ids = _setup(precision, checkpointing)
    terms = activation_terms(cfg, B, 1, False, checkpointing, local_params(cfg, 1))
    z = Sizes.of(cfg, B, 1, False)
    predicted = terms.stored - z.full(z.act * z.vocab)  # the returned fp32 logits are live, not saved
    saved = _saved_bytes(model, ids, precision)
    print(f"{precision} {checkpointing}: saved {saved} B, formula {predicted} B ({predicted / saved - 1:+.2%})")
    assert abs(predicted / saved - 1) < 0.05


def test_saved_bytes_rdm_swiglu_sandwich():
    """The other block and injection variants: concat injection, SwiGLU, sandwich norms."""
    extra = ["model.arch=rdm", "model.injection=concat", "model.mlp=swiglu", "model.block=sandwich"]
    for precision in ("fp32", "bf16"):
        cfg, model, ids = _setup(precision, "none", extra)
        terms = activation_terms(cfg, B, 1, False, "none", local_params(cfg, 1))
        z = Sizes.of(cfg, B, 1, False)
        predicted = terms.stored - z.full(z.act * z.vocab)
        saved = _saved_bytes(model, ids, precision)
        print(f"rdm {precision}: saved {saved} B, formula {predicted} B ({predicted / saved - 1:+.2%})")
        assert abs(predicted / saved - 1) < 0.05


@pytest.mark.parametrize("precision,checkpointing", [("fp32", "none"), ("fp32", "block"), ("fp32", "lap"),
                                                     ("bf16", "none")])
def test_peak_live_bytes_match_formula(precision, checkpointing):
    cfg, model, ids = _setup(precision, checkpointing)
    with _autocast(precision):
        model(ids, labels=ids, depth=3, backprop_depth=2).loss.backward()  # gradients exist: not counted below
    with live_tensor_peak() as live:
        with _autocast(precision):
            out = model(ids, labels=ids, depth=3, backprop_depth=2)
        out.loss.backward()
        del out
    terms = activation_terms(cfg, B, 1, False, checkpointing, local_params(cfg, 1))
    print(f"{precision} {checkpointing}: measured peak {live.peak} B, formula {terms.peak} B "
          f"({terms.peak / live.peak - 1:+.2%})")
    assert live.final < 0.01 * live.peak, "everything allocated in the step must be freed by its end"
    assert abs(terms.peak / live.peak - 1) < 0.10


def test_checkpointing_orders_memory():
    """lap keeps less than block, block less than none, for the kept laps."""
    cfg = load_config(None, SMALL)
    params = local_params(cfg, 1)
    laps = {ck: activation_terms(cfg, B, 1, False, ck, params).laps for ck in ("none", "block", "lap")}
    assert laps["lap"] < laps["block"] < laps["none"]
