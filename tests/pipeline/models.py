"""parcae-tiny-sized models, batches and gradient helpers shared by the pipeline tests (fp32, CPU)."""
from __future__ import annotations

import torch

from megaloop.config import ModelConfig
from megaloop.model import build_model
from megaloop.model.tp_plan import tensor_parallel_plan
from pipeline.layout import ModelDims

# parcae-tiny: d=128, 4 heads of 32, 1/2/1 layers, vocab 4096; the variants cover every plan style.
TINY = dict(arch="parcae", vocab_size=4096, d_model=128, n_heads=4, n_prelude=1, n_core=2, n_coda=1,
            injection="diagonal", seq_len=64, mu_rec=4, mu_bwd=2)
CASES = {
    "parcae": {},
    "parcae-gqa-swiglu": dict(n_heads=8, n_kv_heads=4, mlp="swiglu", mlp_hidden=256),
    "rdm": dict(arch="rdm", injection="concat", block="sandwich", use_C=False),
    "gpt": dict(arch="gpt", injection="none", prelude_norm=False, use_C=False, mu_rec=1, mu_bwd=None,
                n_prelude=0, n_core=4, n_coda=0),
}


def case_config(case: str) -> ModelConfig:
    cfg = ModelConfig(**{**TINY, **CASES[case]})
    cfg.validate()
    return cfg


def dims(cfg: ModelConfig) -> ModelDims:
    return ModelDims(cfg.n_heads, cfg.kv_heads, cfg.vocab_size, cfg.seq_len)


def plan_for(cfg: ModelConfig):
    return tensor_parallel_plan(cfg.mlp)


def make_model(case: str, seed: int = 0) -> torch.nn.Module:
    """The reference init, then every parameter perturbed (the init zeroes the output projections)."""
    cfg = case_config(case)
    model = build_model(cfg, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def make_batch(cfg: ModelConfig, batch: int, seed: int = 0):
    """(ids, labels, per-sequence depths) with a few ignored labels."""
    g = torch.Generator().manual_seed(1000 + seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g)
    labels[:, :3] = -100
    if cfg.is_looped:
        depth = torch.randint(1, 2 * cfg.mu_rec, (batch,), generator=g)
    else:
        depth = torch.ones(batch, dtype=torch.long)
    return ids, labels, depth


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in model.named_parameters()}


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(max |b|, 1e-12): one relative error per tensor."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def muon_functions():
    """megaloop's per-matrix Muon math, bundled for pipeline's distributed Muon (the trainer does the same)."""
    from megaloop.optim import muon
    from pipeline.dist_muon import MuonFunctions

    return MuonFunctions(init_state=muon.init_muon_state, hparams=muon.MuonHParams, update=muon.muon_update,
                         apply=muon.apply_muon_update, lr_scale=muon.muon_lr_scale)


def optim_config(**overrides):
    """Muon + AdamW with weight decay on both and clipping that bites (synthetic gradients have norm >> 1)."""
    from megaloop.optim import OptimConfig

    base = dict(name="muon", matrix_lr=0.02, adam_lr=0.01, adam_weight_decay=0.1, muon_weight_decay=0.2,
                grad_clip=1.0, muon_momentum_warmup_steps=2, cooldown_fraction=0.5)
    base.update(overrides)
    return OptimConfig(**base).validate()


def synthetic_grads(model: torch.nn.Module, step: int) -> dict[str, torch.Tensor]:
    """Full-size gradients, a pure function of (parameter index, step)."""
    out = {}
    for index, (name, p) in enumerate(model.named_parameters()):
        g = torch.Generator().manual_seed(10_000 * step + index)
        out[name] = torch.randn(p.shape, generator=g)
    return out
