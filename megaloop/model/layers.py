"""Small building blocks: RMSNorm, interleaved RoPE and the MLPs (the initialisation is in init.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def upcast(x: torch.Tensor) -> torch.Tensor:
    """x in at least fp32: bf16/fp16 become fp32, fp32 and fp64 stay (the fp64 verification precision stays fp64)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


class RMSNorm(nn.Module):
    """RMSNorm with a learnable weight (init 1), normalised in (at least) fp32 then cast back (the reference's
    recipe)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = upcast(x)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def rms_norm_weightless(x: torch.Tensor) -> torch.Tensor:
    """QK-norm: weightless RMS normalisation over the last dim (torch's default eps). Returns x's dtype, as RMSNorm
    does: CUDA autocast runs rms_norm in fp32, and fp32 queries/keys beside bf16 values would send every attention
    call to SDPA instead of the configured flash/TE kernel."""
    return F.rms_norm(x, (x.size(-1),)).to(x.dtype)


def rope_tables(head_dim: int, seq_len: int, base: float,
                dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [seq_len, head_dim // 2], computed on the CPU in `dtype` (fp32 as the reference; fp64 for
    the fp64 verification precision); pair j of a head rotates by pos * base^(-2j/head_dim)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=dtype) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=dtype), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent channel pairs (2j, 2j+1) of x [B, S, H, D] in (at least) fp32; returns x's dtype. cos/sin:
    the tables [>= S, D / 2] of positions 0, 1, ... (every row alike), or per-token tables [B, S, D / 2] (document
    masking: positions restart at each document)."""
    s = x.shape[1]
    pairs = upcast(x).unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    if cos.dim() == 3:
        c, si = cos[:, :s, None, :], sin[:, :s, None, :]
    else:
        c, si = cos[:s, None, :], sin[:s, None, :]
    rotated = torch.stack((even * c - odd * si, odd * c + even * si), dim=-1).flatten(-2)
    return rotated.type_as(x)


class ReluSquaredMLP(nn.Module):
    """fc -> 0.5 * relu(x)^2 -> proj (no biases)."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(d, hidden, bias=False)
        self.proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(0.5 * F.relu(self.fc(x)).square())


class SwiGLUMLP(nn.Module):
    """Huginn's gated SiLU MLP: fc gives [gate, up] (2 x hidden), proj maps silu(gate) * up back to d."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.fc = nn.Linear(d, 2 * hidden, bias=False)
        self.proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc(x).chunk(2, dim=-1)
        return self.proj(F.silu(gate) * up)
