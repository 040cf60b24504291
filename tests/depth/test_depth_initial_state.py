"""Seeded h_0: rows keyed by the global sample index, truncated normal with the requested std."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats

from megaloop.depth import initial_state

SEQ, D, SEED, STEP = 16, 24, 7, 3


def test_rows_identical_across_batch_compositions():
    big = initial_state(4, SEQ, D, SEED, STEP, [10, 11, 12, 13], std=0.05)
    small = initial_state(2, SEQ, D, SEED, STEP, np.array([12, 99]), std=0.05)
    single = initial_state(1, SEQ, D, SEED, STEP, torch.tensor([11]), std=0.05)
    assert torch.equal(big[2], small[0])
    assert torch.equal(big[1], single[0])
    assert not torch.equal(big[0], big[1])


def test_rows_change_with_seed_step_and_index():
    base = initial_state(1, SEQ, D, SEED, STEP, [5], std=1.0)
    assert not torch.equal(base, initial_state(1, SEQ, D, SEED + 1, STEP, [5], std=1.0))
    assert not torch.equal(base, initial_state(1, SEQ, D, SEED, STEP + 1, [5], std=1.0))
    assert not torch.equal(base, initial_state(1, SEQ, D, SEED, STEP, [6], std=1.0))


def test_std_and_truncation():
    """std is the parent normal's: the truncated draw has std * sd(truncnorm(-3, 3)) ~ 0.98658 std, |x| <= 3 std."""
    std = math.sqrt(2 / (5 * 768))
    h0 = initial_state(64, 128, 128, SEED, STEP, np.arange(64), std=std).double()
    expected_std = std * stats.truncnorm(-3, 3).std()
    count = h0.numel()
    # standard error of the sample std: sigma * sqrt((kurtosis - 1) / (4 N)); truncnorm(-3,3) kurtosis ~ 2.92
    se_std = expected_std * math.sqrt((stats.truncnorm(-3, 3).stats(moments="k") + 3 - 1) / (4 * count))
    print(f"\nh0 std {h0.std().item():.6f} vs {expected_std:.6f} (se {se_std:.2e}); "
          f"max |h0| / std = {h0.abs().max().item() / std:.4f}")
    assert abs(h0.std().item() - expected_std) <= 5 * se_std
    assert abs(h0.mean().item()) <= 5 * expected_std / math.sqrt(count)
    assert h0.abs().max().item() <= 3 * std * (1 + 1e-6)
    assert h0.abs().max().item() >= 2.9 * std
    tail = (h0.abs() > 2 * std).double().mean().item()
    expected_tail = 2 * (stats.norm.cdf(3) - stats.norm.cdf(2)) / (2 * stats.norm.cdf(3) - 1)
    assert abs(tail - expected_tail) <= 5 * math.sqrt(expected_tail * (1 - expected_tail) / count)


def test_dtype_is_the_rounded_float32_draw():
    full = initial_state(2, SEQ, D, SEED, STEP, [1, 2], std=0.1)
    half = initial_state(2, SEQ, D, SEED, STEP, [1, 2], std=0.1, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and half.shape == (2, SEQ, D)
    assert torch.equal(half, full.to(torch.bfloat16))


def test_bad_arguments():
    with pytest.raises(ValueError, match="sample_indices"):
        initial_state(3, SEQ, D, SEED, STEP, [1, 2], std=0.1)
    with pytest.raises(ValueError, match="std"):
        initial_state(1, SEQ, D, SEED, STEP, [1], std=0.0)


def test_a_single_sample_index_for_a_batch_says_one_per_row():
    """The README's noise_key=(seed, step, sample_index): one index per row, and the error says so."""
    from megaloop.config import load_config
    from megaloop.model import build_model

    tiny = Path(__file__).resolve().parents[2] / "configs" / "parcae-tiny.yaml"
    cfg = load_config(str(tiny), ["model.vocab_size=512", "model.d_model=64", "model.n_heads=2",
                                     "model.seq_len=16", "model.ve_gate_channels=16"])
    model = build_model(cfg.model)
    ids = torch.randint(0, 512, (2, 16))
    with pytest.raises(ValueError, match="one global sample index per row"):
        model(ids, depth=2, noise_key=(SEED, STEP, 5))
    out = model(ids, depth=2, noise_key=(SEED, STEP, torch.tensor([5, 6])))  # the advice, followed
    assert out.logits.shape[:2] == (2, 16)
