"""Causal self-attention of the reference block: q/k/v/proj, interleaved RoPE, weightless QK-norm after RoPE,
gated value embeddings; the attention kernel is chosen by name (SDPA on CPU, flash-attn on GPU when installed)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megaloop.model.layers import apply_rope_interleaved, rms_norm_weightless, upcast


def _flash_attn_func():
    """flash-attn's function if it is installed and usable on this machine, else None."""
    if not torch.cuda.is_available():
        return None
    try:
        from flash_attn_interface import flash_attn_func  # FA3 (Hopper)
        return flash_attn_func
    except (ImportError, OSError):
        pass
    try:
        from flash_attn import flash_attn_func  # FA2
        return flash_attn_func
    except (ImportError, OSError):
        return None


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """q [B, S, H, D], k/v [B, S, Hkv, D] -> [B, S, H, D], causal, scale 1/sqrt(D)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    if backend in ("auto", "flash") and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        fn = _flash_attn_func()
        if fn is not None:
            out = fn(q, k, v, causal=True, softmax_scale=scale)
            return out[0] if isinstance(out, tuple) else out
        if backend == "flash":
            raise RuntimeError("model.attn_backend=flash but flash-attn is not installed; use auto or sdpa")
    if k.shape[2] != q.shape[2]:
        rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if backend == "math":
        s = q.shape[2]
        scores = (upcast(q) @ upcast(k).transpose(-1, -2)) * scale
        mask = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
        out = scores.masked_fill(mask, float("-inf")).softmax(-1) @ upcast(v)
        return out.to(q.dtype).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, d: int, n_heads: int, n_kv_heads: int, has_ve: bool, ve_gate_channels: int = 32,
                 backend: str = "auto"):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = d // n_heads
        self.backend = backend
        self.q = nn.Linear(d, n_heads * self.head_dim, bias=False)
        self.k = nn.Linear(d, n_kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(d, n_kv_heads * self.head_dim, bias=False)
        self.proj = nn.Linear(n_heads * self.head_dim, d, bias=False)
        self.ve_gate_channels = ve_gate_channels
        self.ve_gate = nn.Linear(ve_gate_channels, n_kv_heads, bias=False) if has_ve else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                ve: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        # Head counts come from the weights so that a tensor-parallel plan can shard them without touching this code.
        q = self.q(x).view(b, s, -1, self.head_dim)
        k = self.k(x).view(b, s, -1, self.head_dim)
        v = self.v(x).view(b, s, -1, self.head_dim)
        if self.ve_gate is not None and ve is not None:
            gate = 2.0 * torch.sigmoid(self.ve_gate(x[..., : self.ve_gate_channels]))
            v = v + gate.unsqueeze(-1) * ve.view(b, s, -1, self.head_dim)
        cos, sin = rope
        q = rms_norm_weightless(apply_rope_interleaved(q, cos, sin))
        k = rms_norm_weightless(apply_rope_interleaved(k, cos, sin))
        y = causal_attention(q, k, v, self.backend)
        return self.proj(y.reshape(b, s, -1))
