"""Document-aware attention (model.doc_mask) in one process.

- The document structure is built right from the BOS positions: starts, within-document positions, segment ids,
  the block-causal mask and the varlen aid (cu_seqlens, documents per row, longest document), and its prefixes and
  permutations, all against hand-computed values.
- Packed rows of three documents (5, 9, 18 tokens, ...; see doc_mask_cases.py) with doc_mask on give each
  document's logits and per-token losses, and the batch's loss, of that document run alone (a batch of one, no
  padding, doc_mask off), at T = 1, T = mu_rec and mixed per-sequence depths with truncated backprop (the
  trainer's path): within 1e-6 in fp32 and 1e-12 in fp64 (max |a - b| / max(max |b|, 1)); in fp64 every
  parameter's gradient too. Activation checkpointing (lap, block) and the masked loop see the same mask.
- The varlen call code of flash-attn (2 and 3) and Transformer Engine, run on the CPU with stand-ins that compute
  what those kernels compute from cu_seqlens, gives the same numbers through the ragged loop's permuted prefixes.
- With doc_mask off nothing changes: no document structure is built, SDPA gets its plain causal call, and
  documents packed in a row attend to each other as before.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megaloop.model import attention, build_model
from megaloop.model.attention import set_attention_backend
from megaloop.model.documents import Documents, attention_share
from tests.model.doc_mask_cases import (BOS, DEPTH_CASES, TOL, alone, batch, grads, model_pair, packed, rel_err,
                                        worst_grad_err)

DTYPES = {"fp32": torch.float32, "fp64": torch.float64}


def _tables(s: int = 8):
    angles = torch.arange(s, dtype=torch.float64)[:, None] * torch.tensor([1.0, 0.1], dtype=torch.float64)
    return angles.cos(), angles.sin()


def test_structure_from_bos_positions_is_hand_computed():
    a = 7  # any token that is not BOS
    ids = torch.tensor([[BOS, a, a, BOS, a, BOS, a, a],    # documents 3, 2, 3
                        [a, a, BOS, a, a, a, BOS, a]])     # 2 tokens before the first BOS, then 4 and 2
    cos, sin = _tables()
    dense = Documents.build(ids, BOS, (cos, sin), "dense")
    assert dense.starts.int().tolist() == [[1, 0, 0, 1, 0, 1, 0, 0], [1, 0, 1, 0, 0, 0, 1, 0]]
    positions = [[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 0, 1, 2, 3, 0, 1]]
    assert dense.segments.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 1, 1, 1, 1, 2, 2]]
    assert torch.equal(dense.cos, cos[torch.tensor(positions)]) and torch.equal(dense.sin, sin[torch.tensor(positions)])
    row1 = ["10000000",  # query 0 sees key 0
            "11000000",
            "00100000",  # the first BOS starts a new document
            "00110000",
            "00111000",
            "00111100",
            "00000010",
            "00000011"]
    assert dense.mask.shape == (2, 1, 8, 8)
    assert ["".join(str(int(x)) for x in r) for r in dense.mask[1, 0].tolist()] == row1
    assert torch.equal(dense.mask[0, 0, 4], torch.tensor([0, 0, 0, 1, 1, 0, 0, 0], dtype=torch.bool))

    varlen = Documents.build(ids, BOS, (cos, sin), "varlen")
    assert varlen.mask is None and varlen.varlen.cu_seqlens.dtype == torch.int32
    assert varlen.varlen.cu_seqlens.tolist() == [0, 3, 5, 8, 10, 14, 16] and varlen.varlen.max_len == 4
    assert varlen.varlen.row_docs.tolist() == [0, 3, 6]
    first = varlen.head(1)
    assert first.varlen.cu_seqlens.tolist() == [0, 3, 5, 8] and first.varlen.max_len == 3
    assert first.segments.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]
    swapped = varlen.take(np.array([1, 0]))
    assert swapped.varlen.cu_seqlens.tolist() == [0, 2, 6, 8, 11, 13, 16] and swapped.varlen.max_len == 4
    assert torch.equal(swapped.cos[0], varlen.cos[1]) and swapped.head(1).varlen.max_len == 4
    assert torch.equal(dense.take(np.array([1, 0])).mask[0], dense.mask[1])
    assert torch.equal(varlen.dense_mask(), dense.mask)
    # sum of squared document lengths over S^2, per row: (9 + 4 + 9) / 64 and (4 + 16 + 4) / 64
    assert attention_share(ids.numpy(), BOS) == pytest.approx((22 / 64 + 24 / 64) / 2, abs=1e-15)


@pytest.mark.parametrize("case", list(DEPTH_CASES))
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_packed_documents_equal_each_document_alone(dtype, case):
    dt, depths = DTYPES[dtype], DEPTH_CASES[case]
    masked, plain = model_pair(dt)
    ids, labels, h0 = batch(dt, masked.cfg.d_model, masked.cfg.vocab_size)
    logits, per_token, loss = packed(masked, ids, labels, h0, depths)
    ref_logits, ref_per_token, ref_loss = alone(plain, ids, labels, h0, depths)
    errs = {"logits": rel_err(logits, ref_logits), "token losses": rel_err(per_token, ref_per_token),
            "loss": rel_err(loss, ref_loss)}
    if dt == torch.float64:
        loss.backward()
        got = grads(masked)
        ref_loss.backward()
        errs["grads"] = worst_grad_err(got, grads(plain))[0]
    print(f"{dtype} {case} depths {depths}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()))
    assert max(errs.values()) <= TOL[dt], errs
    # the check can fail: the same rows with doc_mask off attend across documents
    crossing = rel_err(packed(plain, ids, labels, h0, depths)[0], ref_logits)
    assert crossing > 1e-3


@pytest.mark.parametrize("mode", ["lap", "block", "masked"])
def test_recompute_and_the_masked_loop_see_the_same_mask(mode):
    """Mixed depths in fp64 under activation checkpointing (the recomputed forward must mask as the first did) and
    under the masked loop (every row every lap): logits and gradients of each document alone."""
    depths = DEPTH_CASES["mixed"]
    masked, plain = model_pair(torch.float64)
    if mode == "masked":
        masked.ragged_loop = False
    else:
        masked.set_activation_checkpointing(mode)
    ids, labels, h0 = batch(torch.float64, masked.cfg.d_model, masked.cfg.vocab_size, seed=1)
    logits, _, loss = packed(masked, ids, labels, h0, depths)
    loss.backward()
    ref_logits, _, ref_loss = alone(plain, ids, labels, h0, depths)
    ref_loss.backward()
    err, where = worst_grad_err(grads(masked), grads(plain))
    print(f"{mode}: logits {rel_err(logits, ref_logits):.1e}, worst grad {err:.1e} ({where})")
    assert rel_err(logits, ref_logits) <= 1e-12 and err <= 1e-12


def _reference_varlen(q, k, v, cu, max_len, softmax_scale):
    """flash-attn's varlen contract, written independently: q [T, H, D], k/v [T, Hkv, D]; each document
    [cu[i], cu[i + 1]) attends causally within itself; query head h reads kv head h // (H / Hkv)."""
    out = torch.empty_like(q)
    bounds = cu.tolist()
    assert max_len == max(b - a for a, b in zip(bounds, bounds[1:])), "max_seqlen is not the longest document"
    rep = q.shape[1] // k.shape[1]
    for a, b in zip(bounds, bounds[1:]):
        qd, kd, vd = q[a:b].transpose(0, 1), k[a:b].repeat_interleave(rep, 1).transpose(0, 1), \
            v[a:b].repeat_interleave(rep, 1).transpose(0, 1)
        scores = (qd @ kd.transpose(-1, -2)) * softmax_scale
        causal = torch.ones(b - a, b - a, dtype=torch.bool).tril()
        out[a:b] = (scores.masked_fill(~causal, -math.inf).softmax(-1) @ vd).transpose(0, 1)
    return out


def _stand_in(kind: str, calls: list):
    """What flash_attn_varlen_func (FA2; FA3 returning (out, lse)) or TE's DotProductAttention (thd) compute."""
    def flash(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False):
        assert causal and torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32 and isinstance(max_q, int)
        calls.append(q.shape[0])
        out = _reference_varlen(q, k, v, cu_q, max_q, softmax_scale)
        return (out, None) if kind == "flash3" else out

    def te(q, k, v, qkv_format=None, attn_mask_type=None, cu_seqlens_q=None, cu_seqlens_kv=None,
           max_seqlen_q=None, max_seqlen_kv=None):
        assert qkv_format == "thd" and attn_mask_type == "padding_causal" and isinstance(max_seqlen_q, int)
        assert torch.equal(cu_seqlens_q, cu_seqlens_kv) and cu_seqlens_q.dtype == torch.int32
        calls.append(q.shape[0])
        scale = 1 / math.sqrt(q.shape[-1])
        return _reference_varlen(q, k, v, cu_seqlens_q, max_seqlen_q, scale).reshape(q.shape[0], -1)

    return te if kind == "te" else flash


@pytest.mark.parametrize("kind", ["flash2", "flash3", "te"])
def test_varlen_call_code_through_the_ragged_loop(kind, monkeypatch):
    """The flash-attn / TE varlen paths on the CPU (stand-ins for the kernels; inputs taken as if on a GPU): the
    ragged loop hands each lap the cu_seqlens of its permuted active rows, and the result is each document alone."""
    calls: list = []
    fake = _stand_in(kind, calls)
    monkeypatch.setattr(attention, "_cannot_take", lambda *args: None)
    monkeypatch.setattr(attention, "flash_varlen_function", lambda backend: fake)
    monkeypatch.setattr(attention, "_te_varlen_attention", lambda *args: fake)
    depths = DEPTH_CASES["mixed"]
    masked, plain = model_pair(torch.float64, n_heads=4, n_kv_heads=2)
    set_attention_backend(masked, kind, configured=True)
    ids, labels, h0 = batch(torch.float64, masked.cfg.d_model, masked.cfg.vocab_size, seed=2)
    logits, _, loss = packed(masked, ids, labels, h0, depths)
    ref_logits, _, ref_loss = alone(plain, ids, labels, h0, depths)
    # prelude, coda: 3 rows; the loop (depths 3, 1, 5 end-aligned): laps run 1, 1, 2, 2, 3 rows, two core blocks
    assert sorted(set(calls)) == [32, 64, 96] and calls.count(32) == 2 * 2
    assert rel_err(logits, ref_logits) <= 1e-12 and rel_err(loss, ref_loss) <= 1e-12


def test_doc_mask_off_is_unchanged(monkeypatch):
    """doc_mask off: the context holds no documents (none is ever built), every SDPA call is the plain causal one
    (is_causal, no mask), and the forward is the seams' loop written out, bit for bit."""
    _, plain = model_pair(torch.float64)
    ids, labels, h0 = batch(torch.float64, plain.cfg.d_model, plain.cfg.vocab_size)

    def refuse(*args, **kwargs):
        raise AssertionError("a document structure was built with doc_mask off")

    seen = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((kwargs.get("is_causal"), kwargs.get("attn_mask")))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(Documents, "build", refuse)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    out = plain(ids, labels=labels, depth=2, h0=h0)
    assert plain.context(ids).documents is None
    assert seen and all(causal is True and mask is None for causal, mask in seen)
    ctx = plain.context(ids)
    e, h = plain.encode(ids, ctx), h0
    for _ in range(2):
        h = plain.loop_step(h, e, ctx)
    assert torch.equal(out.logits, plain.logits(plain.decode(h, ctx)))


def test_doc_mask_needs_the_bos_id():
    from megaloop.config import ConfigError
    from tests.model.helpers import small_config

    cfg = small_config(doc_mask=True)
    with pytest.raises(ConfigError, match="model.bos_id.*doc_mask=true needs the BOS token id"):
        build_model(cfg)
    with pytest.raises(ConfigError, match="model.bos_id"):
        small_config(doc_mask=True, bos_id=cfg.vocab_size)
