"""QK-norm hands the attention kernel the compute dtype under CUDA's autocast rule (rms_norm runs in fp32)."""
import torch
import torch.nn.functional as F

from megaloop.model import attention as attn_mod
from megaloop.model import layers
from megaloop.model.layers import rope_tables


def _fp32_rms_norm(real):
    """CUDA autocast's rule for rms_norm, reproduced on CPU: the op computes and returns fp32."""
    def rule(x, shape, *args, **kwargs):
        return real(x.float(), shape, *args, **kwargs)
    return rule


def test_bf16_qkv_reach_the_kernel_under_the_cuda_autocast_rule(monkeypatch):
    monkeypatch.setattr(layers.F, "rms_norm", _fp32_rms_norm(F.rms_norm))
    seen = []
    real_attention = attn_mod.causal_attention

    def counting(q, k, v, backend="auto", strict=False):
        seen.append((q.dtype, k.dtype, v.dtype))
        return real_attention(q, k, v, "sdpa")

    monkeypatch.setattr(attn_mod, "causal_attention", counting)
    torch.manual_seed(0)
    block = attn_mod.Attention(64, 4, 2, has_ve=False, backend="sdpa").to(torch.bfloat16)
    cos, sin = rope_tables(16, 8, 10000.0)
    y = block(torch.randn(2, 8, 64, dtype=torch.bfloat16), (cos, sin))
    assert seen == [(torch.bfloat16,) * 3]  # one kernel call, all in the compute dtype
    assert y.dtype == torch.bfloat16


def test_qk_norm_matches_the_formula_in_fp64():
    x = torch.randn(3, 5, 2, 16, dtype=torch.float64)
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + torch.finfo(torch.float64).eps)
    got = layers.rms_norm_weightless(x)
    assert got.dtype == torch.float64
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
