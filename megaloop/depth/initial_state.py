"""Seeded initial loop state h_0 ~ truncated normal, one generator per sequence.

Row i of h_0 is drawn by its own torch.Generator seeded with `key_seeds(seed, step, sample_index_i, STREAM_H0)`, so a
sequence's h_0 is the same whatever batch, micro-batch or rank it lands in. `std` is the standard deviation of the
normal before truncation (as torch.nn.init.trunc_normal_ and the Parcae reference use it); values are cut at
+-3 std, which leaves an actual standard deviation of about 0.98658 std.

Values are drawn in float32 on `device` by the inverse CDF (u uniform in [Phi(-3), Phi(3)], x = std sqrt(2)
erfinv(2u - 1)) and then cast to `dtype`, so a bf16 h_0 is the rounding of the float32 one. Unlike rejection
sampling (torch.nn.init.trunc_normal_ asks the device whether any value fell outside), nothing is read back to the
host, so a training step's micro-batches never wait for the device here.
Generators of different device types (CPU, CUDA) produce different streams: identity of rows holds on one device type.
"""
from __future__ import annotations

import math
import operator

import numpy as np
import torch

from megaloop.rng import STREAM_H0, key_seeds

TRUNCATION_STDS = 3.0


def _generator_for(device: torch.device, row_seed: int) -> torch.Generator:
    generator = torch.Generator(device=device)
    generator.manual_seed(int(row_seed))
    return generator


def initial_state(batch: int, seq_len: int, d: int, seed: int, step: int, sample_indices, std: float,
                  device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """h_0 of shape [batch, seq_len, d]: row i ~ N(0, std^2) truncated to [-3 std, 3 std], keyed by its sample index.

    sample_indices: the `batch` global sample indices of the rows (list, numpy array or tensor), in row order.
    """
    batch, seq_len, d = (operator.index(v) for v in (batch, seq_len, d))
    if isinstance(sample_indices, torch.Tensor):
        sample_indices = sample_indices.detach().cpu().numpy()
    indices = np.asarray(sample_indices, dtype=np.int64).reshape(-1)
    if indices.size != batch:
        raise ValueError(f"initial_state: got {indices.size} sample_indices for a batch of {batch}; give one global "
                         "sample index per row, e.g. noise_key=(seed, step, torch.arange(batch))")
    if not (std > 0):
        raise ValueError(f"initial_state: std must be > 0, got {std}")
    device = torch.device("cpu" if device is None else device)
    row_seeds = key_seeds(seed, step, indices, STREAM_H0)
    h0 = torch.empty(batch, seq_len, d, device=device, dtype=dtype)
    for row, row_seed in enumerate(row_seeds.tolist()):
        h0[row].copy_(_truncated_normal(seq_len, d, float(std), device, _generator_for(device, row_seed)))
    return h0


def _truncated_normal(seq_len: int, d: int, std: float, device, generator: torch.Generator) -> torch.Tensor:
    """[seq_len, d] float32 ~ N(0, std^2) truncated to +-TRUNCATION_STDS std, by the inverse CDF (no host sync)."""
    low = 0.5 * (1.0 + math.erf(-TRUNCATION_STDS / math.sqrt(2.0)))  # Phi(-3)
    values = torch.empty(seq_len, d, device=device, dtype=torch.float32)
    values.uniform_(2.0 * low - 1.0, 1.0 - 2.0 * low, generator=generator)  # 2u - 1 for u in [Phi(-3), Phi(3)]
    values.erfinv_().mul_(std * math.sqrt(2.0))
    cut = TRUNCATION_STDS * std
    return values.clamp_(-cut, cut)
