"""Small configs and an independent, functional re-derivation of the reference block for model tests."""
from __future__ import annotations

import math

import torch

from megaloop.config import ModelConfig


def small_config(**overrides) -> ModelConfig:
    base = dict(arch="parcae", vocab_size=256, d_model=64, n_heads=4, n_prelude=1, n_core=2, n_coda=1,
                seq_len=16, mu_rec=4, mu_bwd=2, ve_gate_channels=8)
    base.update(overrides)
    cfg = ModelConfig(**base)
    cfg.validate()
    return cfg


def rand_like_params_(model: torch.nn.Module, seed: int = 1, scale: float = 0.1) -> None:
    """Give every parameter non-trivial values (the reference init zeroes the output projections)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm_1.weight") or "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("A_log") or name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(scale * torch.randn(p.shape, generator=g))


def ref_rms(x, w=None, eps=None):
    """RMSNorm from its definition; eps None: torch's default for the weightless QK-norm (float eps)."""
    eps = torch.finfo(x.dtype).eps if eps is None else eps
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def ref_rope(x, base):
    """Interleaved RoPE via complex numbers: channel pair (2j, 2j+1) is the complex number x_2j + i x_2j+1."""
    b, s, h, d = x.shape
    j = torch.arange(d // 2, dtype=torch.float64)
    theta = base ** (-2.0 * j / d)
    angle = torch.arange(s, dtype=torch.float64)[:, None] * theta[None, :]
    rot = torch.polar(torch.ones_like(angle), angle)  # [s, d/2]
    z = torch.view_as_complex(x.double().reshape(b, s, h, d // 2, 2).contiguous())
    return torch.view_as_real(z * rot[None, :, None, :]).reshape(b, s, h, d).to(x.dtype)


def ref_block(x, p: dict, prefix: str, cfg: ModelConfig, ve=None):
    """One pre-norm block written from the formulas, with explicit softmax attention."""
    b, s, d = x.shape
    hd, nh = cfg.head_dim, cfg.n_heads
    xn = ref_rms(x, p[prefix + "norm_1.weight"], cfg.norm_eps)
    q = (xn @ p[prefix + "attn.q.weight"].T).view(b, s, nh, hd)
    k = (xn @ p[prefix + "attn.k.weight"].T).view(b, s, nh, hd)
    v = (xn @ p[prefix + "attn.v.weight"].T).view(b, s, nh, hd)
    if ve is not None:
        gate = 2 * torch.sigmoid(xn[..., : cfg.ve_gate_channels] @ p[prefix + "attn.ve_gate.weight"].T)
        v = v + gate[..., None] * ve.view(b, s, nh, hd)
    q, k = ref_rms(ref_rope(q, cfg.rope_base)), ref_rms(ref_rope(k, cfg.rope_base))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    att = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    y = torch.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, d)
    x = x + y @ p[prefix + "attn.proj.weight"].T
    xn = ref_rms(x, p[prefix + "norm_2.weight"], cfg.norm_eps)
    hidden = 0.5 * torch.relu(xn @ p[prefix + "mlp.fc.weight"].T) ** 2
    return x + hidden @ p[prefix + "mlp.proj.weight"].T
