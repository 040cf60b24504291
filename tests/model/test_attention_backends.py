"""Attention kernels: model.attention resolved once for the device (GPU kernels refused on the CPU, a missing or
broken package named), and the flash-attn / Transformer Engine call code (layout, grouped kv heads, causal
alignment, FA3's tuple) checked on the CPU against SDPA with stand-ins that compute what those kernels compute."""
from __future__ import annotations

import math
import sys

import pytest
import torch

from megaloop.model import attention
from megaloop.model.attention import (
    AttentionBackendError,
    causal_attention,
    flash_call,
    resolve_attention_backend,
    te_call,
)


def reference_flash(q, k, v, causal=True, softmax_scale=None):
    """flash_attn_func's contract, written independently of the code under test: q [B, Sq, H, D], k/v [B, Sk, Hkv,
    D]; query head h attends kv head h // (H / Hkv); the causal mask aligned to the bottom-right corner."""
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    for head in range(h):
        kv = head // (h // hkv)
        scores = torch.einsum("bqd,bkd->bqk", q[:, :, head], k[:, :, kv]) * softmax_scale
        allowed = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)
        scores = scores.masked_fill(~allowed, -math.inf)
        out[:, :, head] = torch.einsum("bqk,bkd->bqd", scores.softmax(-1), v[:, :, kv])
    return out


def _qkv(heads=4, kv_heads=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 16, heads, 8, generator=g)
    k, v = (torch.randn(2, 16, kv_heads, 8, generator=g) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("fa3_tuple", [False, True])
def test_flash_call_layout_and_causal_alignment_match_sdpa(kv_heads, fa3_tuple):
    q, k, v = _qkv(kv_heads=kv_heads)
    fake = (lambda *a, **kw: (reference_flash(*a, **kw), None)) if fa3_tuple else reference_flash
    got = flash_call(fake, q, k.transpose(1, 2).contiguous().transpose(1, 2), v, 1 / math.sqrt(8))  # a strided k
    want = causal_attention(q, k, v, "sdpa")
    assert (got - want).abs().max().item() < 1e-5
    wrong = reference_flash(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, softmax_scale=1.0)
    assert (wrong - want).abs().max().item() > 1e-3  # the check can fail: another scale is caught


def test_te_call_reshapes_tes_output():
    q, k, v = _qkv(kv_heads=2)

    def dot_product_attention(q, k, v):  # TE's DotProductAttention, qkv_format "bshd": [B, S, H * D] out
        b, s, h, d = q.shape
        return reference_flash(q, k, v, softmax_scale=1 / math.sqrt(d)).reshape(b, s, h * d)

    assert (te_call(dot_product_attention, q, k, v) - causal_attention(q, k, v, "sdpa")).abs().max().item() < 1e-5


@pytest.fixture
def packages(tmp_path, monkeypatch):
    """A directory on sys.path for stand-in packages; the real ones hidden, the per-process lookups forgotten."""
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("flash_attn", "flash_attn_interface", "transformer_engine", "transformer_engine.pytorch"):
        monkeypatch.setitem(sys.modules, name, None)  # absent unless a test writes it
    attention.flash_function.cache_clear()
    attention.te_module.cache_clear()
    yield tmp_path
    attention.flash_function.cache_clear()
    attention.te_module.cache_clear()


def _install(root, monkeypatch, name, body):
    (root / name).mkdir()
    (root / name / "__init__.py").write_text(body)
    monkeypatch.delitem(sys.modules, name)
    attention.flash_function.cache_clear()  # looked up again: a new process, as it were


def test_resolution(packages, monkeypatch):
    assert resolve_attention_backend("auto", "cpu") == "sdpa"
    assert resolve_attention_backend("auto", "cuda") == "sdpa"  # nothing installed
    for backend in ("flash2", "flash3", "te"):
        with pytest.raises(AttentionBackendError, match=f"model.attention={backend} needs a CUDA device"):
            resolve_attention_backend(backend, "cpu")
        with pytest.raises(AttentionBackendError, match=f"model.attention={backend} but .* not installed"):
            resolve_attention_backend(backend, "cuda")
    _install(packages, monkeypatch, "flash_attn", "def flash_attn_func(*a, **k):\n    pass\n")
    assert resolve_attention_backend("auto", "cuda") == "flash2"
    _install(packages, monkeypatch, "flash_attn_interface", "raise OSError('libcudart.so.13: cannot open')\n")
    with pytest.raises(AttentionBackendError, match=r"^flash-attn 3 \(flash_attn_interface\) is installed but "
                       r"cannot be imported \(OSError: libcudart.so.13.*pip uninstall flash-attn-3"):
        resolve_attention_backend("auto", "cuda")  # a broken FA3 is an error, not a quiet FA2
    assert resolve_attention_backend("flash2", "cuda") == "flash2"
