"""Causal self-attention of the reference block: q/k/v/proj, interleaved RoPE, weightless QK-norm after RoPE,
gated value embeddings; the attention kernel is chosen by name (SDPA on CPU, flash-attn on GPU when installed).

The kernel is resolved once, when the model is built for its device (:func:`resolve_attention_backend`, called by
the trainer): "auto" becomes "flash" or "sdpa" there, and a flash-attn that is installed but cannot be imported
(a build for another torch or CUDA, a missing shared library) is an error naming the package, never a silent fall
back to SDPA on every call. Only a flash-attn that is absent (ModuleNotFoundError for the package itself) counts
as "not installed".
"""
from __future__ import annotations

import functools
import importlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from megaloop.model.layers import apply_rope_interleaved, rms_norm_weightless, upcast

# (module, function name, label): FA3 (Hopper) first, then FA2
_FLASH_MODULES = (("flash_attn_interface", "flash_attn_func", "flash-attn 3 (flash_attn_interface)"),
                  ("flash_attn", "flash_attn_func", "flash-attn 2 (flash_attn)"))


class AttentionBackendError(RuntimeError):
    """A flash-attn package that is installed but unusable; the message names it and what to do."""


def _import_flash(module: str, func: str, label: str):
    """The kernel function of one flash-attn package; None when the package is not installed at all."""
    try:
        return getattr(importlib.import_module(module), func)
    except ModuleNotFoundError as err:
        if err.name == module:  # the package itself is absent: not installed
            return None
        problem = err
    except Exception as err:  # noqa: BLE001 - an installed package that fails to import, whatever the reason
        problem = err
    raise AttentionBackendError(
        f"{label} is installed but cannot be imported ({type(problem).__name__}: {problem}): it was likely built for "
        f"another torch or CUDA version; reinstall it for this environment (pip install -r requirements-gpu.txt), "
        f"uninstall it (pip uninstall {module.replace('_', '-')}) to use PyTorch's sdpa, or set "
        "model.attn_backend=sdpa") from problem


@functools.lru_cache(maxsize=None)
def flash_attn_function():
    """flash-attn's function (FA3, else FA2) if installed, else None; an installed but broken package raises
    AttentionBackendError. Looked up once per process."""
    for module, func, label in _FLASH_MODULES:
        fn = _import_flash(module, func, label)
        if fn is not None:
            return fn
    return None


def resolve_attention_backend(backend: str, device: torch.device | str) -> str:
    """The concrete kernel for model.attn_backend on `device`: "flash", "sdpa" or "math". auto is flash-attn on a
    CUDA device where installed, else sdpa; flash where flash-attn is absent, or a broken flash-attn, is an error."""
    if torch.device(device).type != "cuda":
        return "sdpa" if backend in ("auto", "flash") else backend
    if backend in ("auto", "flash"):
        if flash_attn_function() is not None:
            return "flash"
        if backend == "flash":
            raise AttentionBackendError("model.attn_backend=flash but flash-attn is not installed here (pip install "
                                        "-r requirements-gpu.txt), or use auto (flash-attn when present, else sdpa)")
        return "sdpa"
    return backend


def set_attention_backend(model: nn.Module, backend: str) -> None:
    """Give every attention layer of `model` the resolved kernel (see resolve_attention_backend)."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.backend = backend


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """q [B, S, H, D], k/v [B, S, Hkv, D] -> [B, S, H, D], causal, scale 1/sqrt(D). backend "flash" runs flash-attn
    on half-precision CUDA inputs (SDPA otherwise); "auto" resolves as resolve_attention_backend does, looked up once
    per process."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    if backend in ("auto", "flash") and q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
        fn = flash_attn_function()
        if fn is not None:
            out = fn(q, k, v, causal=True, softmax_scale=scale)
            return out[0] if isinstance(out, tuple) else out
        if backend == "flash":
            raise AttentionBackendError("model.attn_backend=flash but flash-attn is not installed; use auto or sdpa")
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
