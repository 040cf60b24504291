"""The packed rows of the document-masking tests and their one-process references (shared by
tests/model/test_doc_mask.py and the tp2 / pp2 workers in tests/pipeline/workers_doc_mask.py).

Three rows of 32 tokens, each holding three documents: rows 0 and 1 start with a BOS (row 0: documents of 5, 9 and
18 tokens), row 2 starts with 4 tokens before its first BOS (the cut tail of an earlier document, a document of its
own). Other tokens are drawn from [2, vocab), so BOS (id 1) occurs only where placed. "Alone" runs every document
as a batch of one row of its own length, with doc_mask off, at the depth of the row it was packed in and with the
h_0 slice of its positions: what doc_mask on must give for each document of the packed batch."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from megaloop.model import build_model
from tests.model.helpers import rand_like_params_, small_config

BOS = 1
SEQ = 32
LENGTHS = ([5, 9, 18], [12, 3, 17], [4, 11, 17])
FIRST_IS_BOS = (True, True, False)
DEPTH_CASES = {"T=1": [1, 1, 1], "T=mu_rec": [3, 3, 3], "mixed": [3, 1, 5]}  # mu_rec 3, mu_bwd 2


def config(doc_mask: bool = True, **overrides):
    return small_config(seq_len=SEQ, mu_rec=3, mu_bwd=2, doc_mask=doc_mask, bos_id=BOS if doc_mask else None,
                        **overrides)


def model_pair(dtype: torch.dtype, seed: int = 0, **overrides):
    """(doc_mask model, the same weights with doc_mask off), in `dtype`."""
    masked = build_model(config(True, **overrides)).to(dtype)
    rand_like_params_(masked, seed=seed)
    plain = build_model(config(False, **overrides)).to(dtype)
    plain.load_state_dict(masked.state_dict())
    return masked, plain


def starts_of(lengths) -> list[int]:
    return np.cumsum([0, *lengths[:-1]]).tolist()


def batch(dtype: torch.dtype, d_model: int, vocab: int, seed: int = 0):
    """(ids [3, 32], labels [3, 32] with a few -100, h0 [3, 32, d])."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (len(LENGTHS), SEQ), generator=g)
    for row, (lengths, first) in enumerate(zip(LENGTHS, FIRST_IS_BOS)):
        for i, start in enumerate(starts_of(lengths)):
            if i or first:
                ids[row, start] = BOS
    labels = torch.randint(2, vocab, (len(LENGTHS), SEQ), generator=g)
    labels[0, 7] = labels[2, 30] = -100
    h0 = 0.3 * torch.randn(len(LENGTHS), SEQ, d_model, generator=g, dtype=dtype)
    return ids, labels, h0


def backprop(depths) -> list[int]:
    """The trainer's per-sequence k_i = min(T_i, mu_bwd)."""
    return [min(t, 2) for t in depths]


def packed(model, ids, labels, h0, depths):
    """The packed batch: (logits, per-token losses, mean loss)."""
    out = model(ids, labels=labels, depth=torch.tensor(depths), backprop_depth=backprop(depths), h0=h0)
    per_token = F.cross_entropy(out.logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
    return out.logits, per_token, out.loss


def alone(model, ids, labels, h0, depths):
    """Every document alone: (logits, per-token losses) laid out like the packed batch, and the mean over the
    batch's labelled tokens of the documents' losses (a tensor with gradient)."""
    logits = torch.empty(*ids.shape, model.cfg.vocab_size, dtype=torch.float64)
    per_token = torch.zeros(ids.shape, dtype=torch.float64)
    total = 0.0
    for row, lengths in enumerate(LENGTHS):
        for start, length in zip(starts_of(lengths), lengths):
            cut = slice(start, start + length)
            out = model(ids[row:row + 1, cut], labels=labels[row:row + 1, cut], depth=depths[row],
                        backprop_depth=backprop(depths)[row], h0=h0[row:row + 1, cut])
            logits[row, cut] = out.logits[0].detach().double()
            losses = F.cross_entropy(out.logits[0], labels[row, cut], ignore_index=-100, reduction="none")
            per_token[row, cut] = losses.detach().double()
            total = total + losses.sum()
    return logits, per_token, total / int((labels != -100).sum())


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max(max |b|, 1): absolute for values below 1, relative above."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / max(float(b.abs().max()), 1.0))


def grads(model) -> dict:
    return {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
            for n, p in model.named_parameters()}


def worst_grad_err(got: dict, want: dict) -> tuple[float, str]:
    return max((rel_err(got[n], g), n) for n, g in want.items())


TOL = {torch.float64: 1e-12, torch.float32: 1e-6}
