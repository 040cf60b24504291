"""Depth samplers: how many loop iterations T each sequence runs, and how they split into n (no grad) + k (grad).

Every sampler is a pure function of (seed, step, global sample indices): a per-sequence depth is keyed by the
sequence's global sample index (`megaloop.rng`, stream STREAM_DEPTH), a per-batch depth by (seed, step) alone
(stream STREAM_BATCH_DEPTH), so the depth of a sequence never depends on the rank, the micro-batch or the order in
which it is asked for. Distributions (t = mu_rec - mu_bwd, s = mu_bwd, so t + s = mu_rec):

  fixed                          T = mu_rec
  poisson-truncated-full         T_i = max(Poisson(t + s), 1) per sequence (the released Parcae setting)
  poisson-truncated-full-batch   the same distribution, one draw per global batch
  poisson-lognormal-filling      Huginn: tau ~ LogNormal(ln(t+s) - sigma^2/2, sigma), T = Poisson(tau) + 1, per batch
  poisson-lognormal-filling-seq  the same distribution, one draw per sequence

and always k = min(T, mu_bwd), n = T - k (for Huginn's p this is n = max(p - s, 0), k = min(p, s)).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from megaloop.depth.poisson import (
    lognormal_from_uniform,
    lognormal_poisson_plus_one_moments,
    poisson_at_least_one_moments,
    poisson_inverse_cdf,
)
from megaloop.rng import STREAM_BATCH_DEPTH, STREAM_DEPTH, STREAM_DEPTH_TAU, key_uniform

# Fixed indices of the per-batch uniforms within stream STREAM_BATCH_DEPTH.
BATCH_INDEX_POISSON = 0
BATCH_INDEX_TAU = 1
# Huginn's log-scale standard deviation of the lognormal rate.
LOGNORMAL_SIGMA = 0.5


@dataclass(frozen=True)
class DepthSample:
    """Per-sequence depths of a batch: T = n + k, n iterations without gradient then k with. int64 tensors [B]."""

    T: torch.Tensor
    n: torch.Tensor
    k: torch.Tensor

    def __len__(self) -> int:
        return int(self.T.shape[0])

    def select(self, positions) -> "DepthSample":
        """The depths of the sequences at `positions` (e.g. one micro-batch's index array), in that order."""
        pos = torch.as_tensor(np.asarray(positions, dtype=np.int64))
        return DepthSample(self.T[pos], self.n[pos], self.k[pos])


def split_depth(T, mu_bwd: int):
    """(n, k) with k = min(T, mu_bwd) gradient steps and n = T - k steps without gradient.

    Works on an int, a numpy array or a torch tensor and returns the same kind.
    """
    mu_bwd = operator.index(mu_bwd)
    if mu_bwd < 0:
        raise ValueError(f"split_depth: mu_bwd must be >= 0, got {mu_bwd}")
    if isinstance(T, torch.Tensor):
        k = torch.clamp(T, max=mu_bwd)
    elif isinstance(T, np.ndarray):
        k = np.minimum(T, mu_bwd)
    else:
        k = min(operator.index(T), mu_bwd)
    return T - k, k


def fixed_eval_depth(T: int, batch_size: int) -> DepthSample:
    """Evaluation depth: every sequence runs exactly T iterations, all without gradient (n = T, k = 0)."""
    T = _positive_int("T", T)
    full = torch.full((operator.index(batch_size),), T, dtype=torch.int64)
    return DepthSample(full, full.clone(), torch.zeros_like(full))


def _positive_int(field: str, value) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{field} must be an integer >= 1, got {value!r}")
    try:
        as_int = operator.index(value)
    except TypeError:
        raise ValueError(f"{field} must be an integer >= 1, got {value!r}") from None
    if as_int < 1:
        raise ValueError(f"{field} must be an integer >= 1, got {as_int}")
    return as_int


def _sample_index_array(sample_indices) -> np.ndarray:
    """Global sample indices as a 1-D int64 array; they must be non-negative."""
    if isinstance(sample_indices, torch.Tensor):
        sample_indices = sample_indices.detach().cpu().numpy()
    idx = np.asarray(sample_indices)
    if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
        raise ValueError(f"sample_indices must be a 1-D array of integers, got shape {idx.shape} dtype {idx.dtype}")
    idx = idx.astype(np.int64)
    if idx.size and idx.min() < 0:
        raise ValueError("sample_indices must be non-negative global sample indices")
    return idx


def _step_int(step) -> int:
    step = operator.index(step)
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return step


def _batch_uniforms(seed: int, steps) -> np.ndarray:
    """The per-batch randomness: for each step, the uniforms at indices BATCH_INDEX_POISSON and BATCH_INDEX_TAU of
    stream STREAM_BATCH_DEPTH, as an array [len(steps), 2] (column = index)."""
    step_list = [_step_int(step) for step in np.asarray(steps, dtype=np.int64).reshape(-1).tolist()]
    indices = np.array([BATCH_INDEX_POISSON, BATCH_INDEX_TAU], dtype=np.int64)
    rows = [key_uniform(seed, step, indices, STREAM_BATCH_DEPTH) for step in step_list]
    return np.stack(rows) if rows else np.zeros((0, 2))


class DepthSampler:
    """Base class: validates (mu_rec, mu_bwd, seed), turns drawn depths T into a DepthSample.

    Subclasses set `name` and `granularity` ("sequence": one draw per sequence, "batch": one per global batch)
    and implement `draw_depths` and `_moments`.
    """

    name: ClassVar[str] = ""
    granularity: ClassVar[str] = ""

    def __init__(self, mu_rec: int, mu_bwd: int | None = None, seed: int = 0):
        self.mu_rec = _positive_int("mu_rec", mu_rec)
        self.mu_bwd = math.ceil(self.mu_rec / 2) if mu_bwd is None else _positive_int("mu_bwd", mu_bwd)
        if self.mu_bwd > self.mu_rec:
            raise ValueError(f"mu_bwd must be <= mu_rec ({self.mu_rec}), got {self.mu_bwd}")
        self.seed = operator.index(seed)

    @property
    def rate(self) -> float:
        """t + s with t = max(mu_rec - mu_bwd, 0), s = mu_bwd: the Poisson (or mean lognormal) rate, = mu_rec."""
        return float(max(self.mu_rec - self.mu_bwd, 0) + self.mu_bwd)

    def sample(self, step: int, sample_indices) -> DepthSample:
        """Depths of the sequences with these global sample indices at this step (int64 tensors, same order)."""
        idx = _sample_index_array(sample_indices)
        depths = self.draw_depths(_step_int(step), idx).astype(np.int64)
        n, k = split_depth(depths, self.mu_bwd)
        return DepthSample(torch.from_numpy(depths), torch.from_numpy(n), torch.from_numpy(k))

    def draw_depths(self, step: int, sample_indices: np.ndarray) -> np.ndarray:
        """Total depth T per sample index, a 1-D int64 array (validated inputs)."""
        raise NotImplementedError

    def _moments(self) -> tuple[float, float]:
        raise NotImplementedError

    def mean(self) -> float:
        """E[T] from the closed form."""
        return self._moments()[0]

    def variance(self) -> float:
        """Var[T] from the closed form."""
        return self._moments()[1]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, mu_rec={self.mu_rec}, mu_bwd={self.mu_bwd}, seed={self.seed})"


class FixedDepth(DepthSampler):
    """T = mu_rec for every sequence."""

    name = "fixed"
    granularity = "batch"

    def batch_depths(self, steps) -> np.ndarray:
        """The depth at each of `steps`: always mu_rec."""
        return np.full(np.asarray(steps).reshape(-1).shape, self.mu_rec, dtype=np.int64)

    def draw_depths(self, step, sample_indices):
        return np.full(sample_indices.shape, self.mu_rec, dtype=np.int64)

    def _moments(self):
        return float(self.mu_rec), 0.0


class PoissonTruncatedFull(DepthSampler):
    """T_i = max(Poisson(t + s), 1), one draw per sequence keyed by its global sample index."""

    name = "poisson-truncated-full"
    granularity = "sequence"

    def draw_depths(self, step, sample_indices):
        u = key_uniform(self.seed, step, sample_indices, STREAM_DEPTH)
        return np.maximum(poisson_inverse_cdf(u, self.rate), 1)

    def _moments(self):
        return poisson_at_least_one_moments(self.rate)


class PoissonTruncatedFullBatch(PoissonTruncatedFull):
    """max(Poisson(t + s), 1), one draw per global batch keyed by (seed, step), shared by all its sequences."""

    name = "poisson-truncated-full-batch"
    granularity = "batch"

    def batch_depths(self, steps) -> np.ndarray:
        """The shared depth of the global batch at each of `steps` (1-D int64, one per step)."""
        u = _batch_uniforms(self.seed, steps)[:, BATCH_INDEX_POISSON]
        return np.maximum(poisson_inverse_cdf(u, self.rate), 1)

    def draw_depths(self, step, sample_indices):
        return np.full(sample_indices.shape, self.batch_depths([step])[0], dtype=np.int64)


class PoissonLognormalFilling(DepthSampler):
    """Huginn's sampler: tau ~ LogNormal(ln(t+s) - sigma^2/2, sigma), T = Poisson(tau) + 1, one draw per batch."""

    name = "poisson-lognormal-filling"
    granularity = "batch"
    sigma: ClassVar[float] = LOGNORMAL_SIGMA

    def batch_depths(self, steps) -> np.ndarray:
        """The shared depth of the global batch at each of `steps` (1-D int64, one per step)."""
        u = _batch_uniforms(self.seed, steps)
        tau = lognormal_from_uniform(u[:, BATCH_INDEX_TAU], self.rate, self.sigma)
        return poisson_inverse_cdf(u[:, BATCH_INDEX_POISSON], tau) + 1

    def draw_depths(self, step, sample_indices):
        return np.full(sample_indices.shape, self.batch_depths([step])[0], dtype=np.int64)

    def _moments(self):
        return lognormal_poisson_plus_one_moments(self.rate, self.sigma)


class PoissonLognormalFillingSeq(PoissonLognormalFilling):
    """Huginn's distribution drawn per sequence: tau_i and T_i keyed by the global sample index."""

    name = "poisson-lognormal-filling-seq"
    granularity = "sequence"

    def draw_depths(self, step, sample_indices):
        tau = lognormal_from_uniform(key_uniform(self.seed, step, sample_indices, STREAM_DEPTH_TAU),
                                     self.rate, self.sigma)
        u = key_uniform(self.seed, step, sample_indices, STREAM_DEPTH)
        return poisson_inverse_cdf(u, tau) + 1


SAMPLERS: dict[str, type[DepthSampler]] = {
    cls.name: cls
    for cls in (FixedDepth, PoissonTruncatedFull, PoissonTruncatedFullBatch,
                PoissonLognormalFilling, PoissonLognormalFillingSeq)
}


def make_sampler(name: str, mu_rec: int, mu_bwd: int | None = None, seed: int = 0) -> DepthSampler:
    """The sampler registered under `name`; mu_bwd defaults to ceil(mu_rec / 2)."""
    if name not in SAMPLERS:
        raise ValueError(f"unknown depth sampler {name!r}; valid names: {', '.join(sorted(SAMPLERS))}")
    return SAMPLERS[name](mu_rec, mu_bwd, seed)
