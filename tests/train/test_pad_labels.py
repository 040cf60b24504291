"""Pad targets carry no label (megaloop.train.labels): the loss over a padded row (a best-fit split's last row) is
the loss over its real tokens, in training's micro-batches and in validation's."""
from __future__ import annotations

import numpy as np
import torch

from megaloop.config import ModelConfig
from megaloop.model import build_model
from megaloop.train.evaluate import _micro_batch
from megaloop.train.labels import next_token_labels
from megaloop.train.step import MicroBatch, _stage_micro_batches

BOS, EOS, PAD = 0, 1, 2
SEQ = 16


def _padded_rows() -> torch.Tensor:
    """Two rows of SEQ + 1: a full one, and a split's last row: two documents, then padding."""
    g = torch.Generator().manual_seed(0)
    full = torch.cat([torch.tensor([BOS]), torch.randint(3, 200, (SEQ,), generator=g)])
    last = torch.tensor([BOS, 7, 8, 9, EOS, BOS, 10, 11, EOS] + [PAD] * (SEQ + 1 - 9))
    return torch.stack([full, last])


def test_labels_aiming_at_padding_are_ignored():
    rows = _padded_rows()
    labels = next_token_labels(rows, PAD)
    assert labels[1].tolist() == [7, 8, 9, EOS, BOS, 10, 11, EOS] + [-100] * (SEQ - 8)
    assert torch.equal(labels[0], rows[0, 1:])
    assert torch.equal(next_token_labels(rows, None), rows[:, 1:])  # no pad id (a synthetic batch): as before


def test_the_trainer_and_validation_mask_the_pad_targets():
    rows = _padded_rows()
    plan = [MicroBatch(np.array([1, 0]), np.array([2, 2]), np.array([1, 1]))]
    staged = _stage_micro_batches(rows, torch.tensor([5, 6]), plan, torch.device("cpu"), (0, 3), pad_id=PAD)
    assert torch.equal(staged[0].labels, next_token_labels(rows[[1, 0]], PAD))
    assert torch.equal(staged[0].input_ids, rows[[1, 0], :-1])
    batch = {"tokens": rows, "sample_index": torch.tensor([0, 1]), "valid": torch.tensor([True, False]),
             "pad_id": PAD}
    val = _micro_batch(batch, 2, 0, "cpu")
    assert val.labels[0].tolist() == rows[0, 1:].tolist() and (val.labels[1] == -100).all()
    assert int((_micro_batch({**batch, "tokens": rows.flip(0)}, 2, 0, "cpu").labels != -100).sum()) == 8


def test_the_loss_over_a_padded_row_is_the_loss_over_its_real_tokens():
    cfg = ModelConfig(arch="parcae", vocab_size=260, d_model=32, n_heads=2, n_prelude=1, n_core=2, n_coda=1,
                      seq_len=SEQ, mu_rec=2, mu_bwd=1, ve_gate_channels=8)
    model = build_model(cfg, device="cpu", seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the reference init zeroes output projections: give every weight a value
        for p in model.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    model.eval()
    row = _padded_rows()[1:]
    real = int((row[0] != PAD).sum())  # 9 real tokens: 8 labels
    h0 = torch.randn(1, SEQ, cfg.d_model, generator=g)
    with torch.no_grad():
        padded = model(row[:, :-1], labels=next_token_labels(row, PAD), depth=2, h0=h0).loss
        alone = model(row[:, :real - 1], labels=row[:, 1:real], depth=2, h0=h0[:, :real - 1]).loss
    torch.testing.assert_close(padded, alone, rtol=1e-5, atol=1e-6)
