"""Document masking on the GPU kernels (skipped without a CUDA GPU; run by scripts/gpu_check.sh): flash-attn 2 and
3 (flash_attn_varlen_func over cu_seqlens) and Transformer Engine (DotProductAttention, qkv_format "thd",
"padding_causal"), each where installed, in bf16 on the packed rows of doc_mask_cases.py (mixed per-sequence depths,
grouped kv heads, head_dim 64): every attention call runs the named kernel (counted, no fallback), the logits and
the loss agree with sdpa's dense block-causal mask on the same model within bf16 noise (2e-2 of the largest logit),
with every document run alone through the kernel's plain causal call, and the gradients are finite and agree
with sdpa's (2e-2 of the largest)."""
from __future__ import annotations

import pytest
import torch

from megaloop.model.attention import (flash_function, kernel_calls, reset_kernel_calls, set_attention_backend,
                                      te_module)
from tests.model.doc_mask_cases import DEPTH_CASES, alone, batch, grads, model_pair, packed, rel_err

pytestmark = pytest.mark.gpu
BF16_TOL = 2e-2
SIZES = dict(d_model=256, n_heads=4, n_kv_heads=2)


def _installed(kind: str) -> bool:
    if kind == "te":
        return te_module() is not None
    return flash_function(kind) is not None


def _run(model, kind: str, ids, labels, h0, depths):
    set_attention_backend(model, kind, configured=kind != "sdpa")
    model.zero_grad(set_to_none=True)
    reset_kernel_calls()
    logits, _, loss = packed(model, ids, labels, h0, depths)
    calls, fallbacks = kernel_calls()
    loss.backward()
    return logits.float(), loss.float(), grads(model), calls, fallbacks


@pytest.mark.parametrize("kind", ["flash2", "flash3", "te"])
def test_varlen_kernels_equal_the_dense_mask_and_each_document_alone(kind):
    if not _installed(kind):
        pytest.skip(f"{kind} is not installed here")
    depths = DEPTH_CASES["mixed"]
    masked, plain = model_pair(torch.float32, **SIZES)
    masked, plain = masked.cuda().bfloat16(), plain.cuda().bfloat16()
    ids, labels, h0 = batch(torch.bfloat16, masked.cfg.d_model, masked.cfg.vocab_size)
    ids, labels, h0 = ids.cuda(), labels.cuda(), h0.cuda()
    logits, loss, got, calls, fallbacks = _run(masked, kind, ids, labels, h0, depths)
    ref_logits, ref_loss, ref_grads, _, _ = _run(masked, "sdpa", ids, labels, h0, depths)
    set_attention_backend(plain, kind, configured=True)
    alone_logits = alone(plain, ids, labels, h0, depths)[0]
    worst = max(rel_err(got[n], g) for n, g in ref_grads.items())
    finite = all(torch.isfinite(g).all() for g in got.values())
    print(f"{kind}: calls {calls}, fallbacks {fallbacks}; vs sdpa: logits {rel_err(logits, ref_logits):.1e}, loss "
          f"{rel_err(loss, ref_loss):.1e}, worst grad {worst:.1e}; vs alone: logits "
          f"{rel_err(logits, alone_logits):.1e}")
    assert calls.get(kind, 0) > 0 and set(calls) == {kind} and not fallbacks
    assert rel_err(logits, ref_logits) <= BF16_TOL and rel_err(loss, ref_loss) <= BF16_TOL
    assert rel_err(logits, alone_logits.to(logits.device)) <= BF16_TOL
    assert finite and worst <= BF16_TOL
