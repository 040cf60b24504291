"""Causal self-attention of the reference block: q/k/v/proj, interleaved RoPE, weightless QK-norm after RoPE,
gated value embeddings; the attention kernel is chosen by name (model.attention).

Kernels: sdpa (PyTorch's scaled_dot_product_attention; the CPU's), flash2 (flash-attn 2, package flash_attn), flash3
(flash-attn 3 for Hopper, module flash_attn_interface), te (Transformer Engine's DotProductAttention: cuDNN fused
attention or flash-attn, chosen by TE), math (explicit products in fp32: the reference). All take q [B, S, H, D] and
k/v [B, S, Hkv, D], causal, scale 1/sqrt(D). The flash kernels and TE take that layout and grouped kv heads as they
are (query head h reads kv head h // (H / Hkv), as repeat_interleave gives SDPA); with S_q = S_k their causal mask
(bottom-right aligned) is SDPA's (top-left aligned).

Document masking (model.doc_mask): the blocks then get a megaloop.model.documents.Documents in place of the RoPE
tables, and each token attends only within its own document. sdpa and math take its block-causal boolean mask;
flash2/flash3 run flash-attn's varlen function over the flattened rows (q/k/v [B * S, H, D], cu_seqlens over the
documents, causal within each); te runs DotProductAttention with qkv_format "thd" and attn_mask_type
"padding_causal" (cu_seqlens given for queries and keys, the longest document as a host integer so that TE does not
derive it on the device). Without document masking every call is the plain causal one, as before.

The kernel is resolved once, when the model is built for its device (:func:`resolve_attention_backend`, called by
the trainer, which prints it in the run header): "auto" becomes flash3, flash2 (whichever is installed, in that
order) or sdpa on a CUDA device, sdpa on the CPU. A flash-attn or Transformer Engine that is installed but cannot be
imported (a build for another torch or CUDA, a missing shared library) is an error naming the package, never a
silent fall back to SDPA on every call. Only a package that is absent (ModuleNotFoundError for the package itself)
counts as "not installed". Nothing here imports flash-attn or Transformer Engine on a CPU device.
"""
from __future__ import annotations

import functools
import importlib
import math
import sys
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from megaloop.model.documents import Documents
from megaloop.model.layers import apply_rope_interleaved, rms_norm_weightless, upcast

# backend -> (module, function name, label)
_FLASH_MODULES = {"flash3": ("flash_attn_interface", "flash_attn_func", "flash-attn 3 (flash_attn_interface)"),
                  "flash2": ("flash_attn", "flash_attn_func", "flash-attn 2 (flash_attn)")}
_VARLEN = "flash_attn_varlen_func"  # the same name in flash_attn and flash_attn_interface
_PIP = {"flash_attn_interface": "flash-attn-3", "flash_attn": "flash-attn",
        "transformer_engine.pytorch": "transformer-engine"}
GPU_BACKENDS = ("flash2", "flash3", "te")
KERNEL_CALLS: Counter = Counter()  # kernel that ran -> calls (eager calls; a compiled graph's are not counted)
FALLBACKS: Counter = Counter()  # why an auto-chosen kernel could not take a call -> calls that ran sdpa instead
_NOTED: set = set()


class AttentionBackendError(RuntimeError):
    """A kernel package that is installed but unusable, or one asked for where it cannot run; the message names it
    and what to do."""


def _import(module: str, label: str, attr: str | None = None):
    """`module` (or its `attr`); None when the package is not installed at all."""
    try:
        loaded = importlib.import_module(module)
        return getattr(loaded, attr) if attr else loaded
    except ModuleNotFoundError as err:
        if err.name == module or module.startswith(f"{err.name}."):  # the package itself is absent
            return None
        problem = err
    except Exception as err:  # noqa: BLE001 - an installed package that fails to import, whatever the reason
        problem = err
    raise AttentionBackendError(
        f"{label} is installed but cannot be imported ({type(problem).__name__}: {problem}): it was likely built for "
        f"another torch or CUDA version; reinstall it for this environment (pip install -r requirements-gpu.txt), "
        f"uninstall it (pip uninstall {_PIP.get(module, module)}) to use PyTorch's sdpa, or set "
        "model.attention=sdpa") from problem


@functools.lru_cache(maxsize=None)
def flash_function(backend: str):
    """flash-attn's function for "flash2" or "flash3" if that package is installed, else None; an installed but
    broken package raises AttentionBackendError. Looked up once per process."""
    module, func, label = _FLASH_MODULES[backend]
    return _import(module, label, func)


@functools.lru_cache(maxsize=None)
def flash_varlen_function(backend: str):
    """flash-attn's varlen function (packed documents, cu_seqlens) for "flash2" or "flash3", or None."""
    module, _, label = _FLASH_MODULES[backend]
    return _import(module, label, _VARLEN)


def flash_attn_function():
    """The flash-attn function auto would pick (FA3, else FA2), or None."""
    for backend in ("flash3", "flash2"):
        fn = flash_function(backend)
        if fn is not None:
            return fn
    return None


@functools.lru_cache(maxsize=None)
def te_module():
    """transformer_engine.pytorch if installed (None if absent; broken: AttentionBackendError). Imported only for a
    CUDA device (TE cannot construct a module without one)."""
    return _import("transformer_engine.pytorch", "Transformer Engine (transformer_engine.pytorch)")


def resolve_attention_backend(backend: str, device: torch.device | str) -> str:
    """The concrete kernel for model.attention on `device`: "sdpa", "flash2", "flash3", "te" or "math". auto is
    flash3, else flash2, on a CUDA device where installed, else sdpa; a GPU kernel asked for on the CPU, or one that
    is not installed, or a broken one, is an error."""
    cuda = torch.device(device).type == "cuda"
    if backend in GPU_BACKENDS and not cuda:
        raise AttentionBackendError(f"model.attention={backend} needs a CUDA device; use auto (sdpa on the CPU) or "
                                    "sdpa")
    if not cuda:
        return "sdpa" if backend == "auto" else backend
    if backend == "auto":
        return next((b for b in ("flash3", "flash2") if flash_function(b) is not None), "sdpa")
    if backend in _FLASH_MODULES and flash_function(backend) is None:
        raise AttentionBackendError(f"model.attention={backend} but {_FLASH_MODULES[backend][2]} is not installed "
                                    "here (pip install -r requirements-gpu.txt), or use auto (flash-attn when "
                                    "present, else sdpa)")
    if backend == "te" and te_module() is None:
        raise AttentionBackendError("model.attention=te but Transformer Engine is not installed here (pip install "
                                    "--no-build-isolation transformer_engine[pytorch]), or use auto")
    return backend


def set_attention_backend(model: nn.Module, backend: str, configured: bool = False) -> None:
    """Give every attention layer of `model` the resolved kernel (see resolve_attention_backend). configured: the
    kernel was named in model.attention (not chosen by auto), so a call it cannot take is an error."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.backend, module.strict = backend, configured


def kernel_calls() -> tuple[dict, dict]:
    """(kernel -> calls, fallback reason -> calls) since the last reset_kernel_calls()."""
    return dict(KERNEL_CALLS), dict(FALLBACKS)


def reset_kernel_calls() -> None:
    KERNEL_CALLS.clear()
    FALLBACKS.clear()


def _ran(kernel: str) -> None:
    if not torch.compiler.is_compiling():
        KERNEL_CALLS[kernel] += 1


def _cannot_take(backend: str, q, k, v) -> str | None:
    """Why a flash or TE kernel cannot take these inputs (they need half-precision CUDA tensors of one dtype)."""
    dtypes = {q.dtype, k.dtype, v.dtype}
    if q.is_cuda and len(dtypes) == 1 and q.dtype in (torch.bfloat16, torch.float16):
        return None
    got = "/".join(str(t.dtype).removeprefix("torch.") for t in (q, k, v))
    return f"{backend} takes bf16 or fp16 CUDA tensors of one dtype, this call has q/k/v {got} on {q.device.type}"


def _fall_back(backend: str, reason: str) -> None:
    """auto chose `backend` but this call cannot run it: run sdpa, say so once per reason, count it."""
    if not torch.compiler.is_compiling():
        FALLBACKS[reason] += 1
    if reason not in _NOTED:
        _NOTED.add(reason)
        print(f"megaloop: note: attention falls back to sdpa: {reason} (model.attention=auto; counted as "
              "fallbacks in the run summary)", file=sys.stderr, flush=True)


def flash_call(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """flash-attn's function on the block's layout: q [B, S, H, D], k/v [B, S, Hkv, D] as they are (grouped kv
    heads and [B, S, H, D] are flash-attn's own layout), causal; FA3 returns (out, lse) in some versions."""
    out = fn(q.contiguous(), k.contiguous(), v.contiguous(), causal=True, softmax_scale=scale)
    return out[0] if isinstance(out, tuple) else out


@functools.lru_cache(maxsize=None)
def _te_attention(heads: int, kv_heads: int, head_dim: int, scale: float):
    """One TE DotProductAttention per shape, kept out of the model's modules (it has no weights; its _extra_state
    stays out of the checkpoint)."""
    return te_module().DotProductAttention(heads, head_dim, num_gqa_groups=kv_heads, qkv_format="bshd",
                                           attn_mask_type="causal", softmax_scale=scale)


def te_call(dpa, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """TE's DotProductAttention (qkv_format "bshd", causal) on the block's layout; it returns [B, S, H * D]."""
    b, s, h, d = q.shape
    return dpa(q.contiguous(), k.contiguous(), v.contiguous()).view(b, s, h, d)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[B, S, H, D] -> [B * S, H, D] (the packed "thd" layout of the varlen kernels)."""
    return x.reshape(-1, *x.shape[2:]).contiguous()


def flash_varlen_call(fn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, rows) -> torch.Tensor:
    """flash-attn's varlen function over the documents of the flattened rows (`rows`: a VarlenRows), causal within
    each document; FA3 returns (out, lse) in some versions."""
    m = rows.max_len
    out = fn(_flat(q), _flat(k), _flat(v), rows.cu_seqlens, rows.cu_seqlens, m, m, softmax_scale=scale, causal=True)
    return (out[0] if isinstance(out, tuple) else out).view(q.shape)


@functools.lru_cache(maxsize=None)
def _te_varlen_attention(heads: int, kv_heads: int, head_dim: int, scale: float):
    """One TE DotProductAttention per shape for packed documents (qkv_format "thd", "padding_causal")."""
    return te_module().DotProductAttention(heads, head_dim, num_gqa_groups=kv_heads, qkv_format="thd",
                                           attn_mask_type="padding_causal", softmax_scale=scale)


def te_varlen_call(dpa, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows) -> torch.Tensor:
    """TE's DotProductAttention on the flattened rows, one sequence per document (cu_seqlens int32 on the device,
    max_seqlen a host integer: no device read); it returns [B * S, H * D]."""
    m = rows.max_len
    out = dpa(_flat(q), _flat(k), _flat(v), qkv_format="thd", attn_mask_type="padding_causal",
              cu_seqlens_q=rows.cu_seqlens, cu_seqlens_kv=rows.cu_seqlens, max_seqlen_q=m, max_seqlen_kv=m)
    return out.view(q.shape)


def _gpu_call(backend: str, q, k, v, scale: float, documents) -> torch.Tensor:
    """A flash or TE kernel on inputs it takes: the plain causal call, or the varlen one over `documents`."""
    h, hkv, d = q.shape[2], k.shape[2], q.shape[3]
    if backend in _FLASH_MODULES:
        if documents is None:
            return flash_call(flash_function(backend), q, k, v, scale)
        return flash_varlen_call(flash_varlen_function(backend), q, k, v, scale, documents.varlen_rows())
    if documents is None:
        return te_call(_te_attention(h, hkv, d, scale), q, k, v)
    return te_varlen_call(_te_varlen_attention(h, hkv, d, scale), q, k, v, documents.varlen_rows())


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "auto",
                     strict: bool = False, documents=None) -> torch.Tensor:
    """q [B, S, H, D], k/v [B, S, Hkv, D] -> [B, S, H, D], causal, scale 1/sqrt(D), with a resolved backend (see
    resolve_attention_backend). The flash kernels and TE take half-precision CUDA inputs of one dtype. A call they
    cannot take (an fp32 evaluation of the same model) runs SDPA when auto chose them, noted once per reason and
    counted; when model.attention named them (strict), it is an AttentionBackendError naming the reason. Every
    eager call counts the kernel that ran (KERNEL_CALLS). documents: a Documents of these rows (model.doc_mask):
    attention within each document only (see the module docstring); None: the whole row."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    if backend == "auto":  # a model built outside the trainer: resolved here (the lookups are cached)
        backend = resolve_attention_backend("auto", q.device)
    if backend in GPU_BACKENDS:
        reason = _cannot_take(backend, q, k, v)
        if reason is None:
            _ran(backend)
            return _gpu_call(backend, q, k, v, scale, documents)
        if strict:
            raise AttentionBackendError(f"model.attention={backend} cannot run this call: {reason}; train in bf16 "
                                        "(train.precision=bf16) or set model.attention=auto (sdpa for such calls)")
        _fall_back(backend, reason)
        backend = "sdpa"
    _ran(backend)
    if k.shape[2] != q.shape[2]:
        rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    allowed = None if documents is None else documents.dense_mask()  # [B, 1, S, S], True: may attend
    if backend == "math":
        s = q.shape[2]
        scores = (upcast(q) @ upcast(k).transpose(-1, -2)) * scale
        hidden = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1) if allowed is None else ~allowed
        out = scores.masked_fill(hidden, float("-inf")).softmax(-1) @ upcast(v)
        return out.to(q.dtype).transpose(1, 2)
    if allowed is not None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale).transpose(1, 2)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, d: int, n_heads: int, n_kv_heads: int, has_ve: bool, ve_gate_channels: int = 32,
                 backend: str = "auto"):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = d // n_heads
        self.backend, self.strict = backend, False  # strict: the kernel was named in model.attention
        self.q = nn.Linear(d, n_heads * self.head_dim, bias=False)
        self.k = nn.Linear(d, n_kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(d, n_kv_heads * self.head_dim, bias=False)
        self.proj = nn.Linear(n_heads * self.head_dim, d, bias=False)
        self.ve_gate_channels = ve_gate_channels
        self.ve_gate = nn.Linear(ve_gate_channels, n_kv_heads, bias=False) if has_ve else None

    def forward(self, x: torch.Tensor, rope, ve: torch.Tensor | None = None) -> torch.Tensor:
        """rope: the RoPE tables (cos, sin) of positions 0 .. S-1, or a Documents of these rows (model.doc_mask:
        per-token positions restarting at each document, attention within each document)."""
        b, s, _ = x.shape
        # Head counts come from the weights so that a tensor-parallel plan can shard them without touching this code.
        q = self.q(x).view(b, s, -1, self.head_dim)
        k = self.k(x).view(b, s, -1, self.head_dim)
        v = self.v(x).view(b, s, -1, self.head_dim)
        compute = q.dtype  # the projections' dtype: bf16 under autocast, the parameters' dtype without
        if self.ve_gate is not None and ve is not None:
            gate = 2.0 * torch.sigmoid(self.ve_gate(x[..., : self.ve_gate_channels]))
            v = v + gate.unsqueeze(-1) * ve.view(b, s, -1, self.head_dim)
        documents = rope if isinstance(rope, Documents) else None
        cos, sin = rope if documents is None else documents.rope
        q = rms_norm_weightless(apply_rope_interleaved(q, cos, sin))
        k = rms_norm_weightless(apply_rope_interleaved(k, cos, sin))
        # RoPE's fp32 tables, CUDA autocast's fp32 rms_norm and the fp32 value embeddings promote q/k/v; the kernel
        # takes them in the compute dtype (what autocast gives SDPA anyway), so flash-attn and TE can run
        q, k, v = q.to(compute), k.to(compute), v.to(compute)
        if documents is None:  # the call as it was before document masking
            y = causal_attention(q, k, v, self.backend, self.strict)
        else:
            y = causal_attention(q, k, v, self.backend, self.strict, documents=documents)
        return self.proj(y.reshape(b, s, -1))
