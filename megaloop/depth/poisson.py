"""Exact draws and exact moments of the depth distributions used by the samplers.

Draws are inverse-CDF transforms of uniforms from `megaloop.rng`, so a depth is a pure function of its key.
Moments are closed forms, used by the samplers' `.mean()` / `.variance()` and by the statistical tests.
"""
from __future__ import annotations

import math

import numpy as np
from scipy.special import ndtri

# Tail beyond which the Poisson CDF cannot be told apart from 1 in float64: lambda + 40 sqrt(lambda) + 60 leaves an
# upper-tail probability far below 2**-53, the resolution of the uniforms.
_TAIL_SIGMAS = 40.0
_TAIL_SLACK = 60


def _validated_uniforms_and_rates(u, lam) -> tuple[np.ndarray, np.ndarray]:
    """Broadcast `u` and `lam` to float64 arrays of one shape; u must lie in (0, 1) and lam be finite and > 0."""
    u_arr, lam_arr = np.broadcast_arrays(np.asarray(u, dtype=np.float64), np.asarray(lam, dtype=np.float64))
    if u_arr.size and not (np.all(u_arr > 0.0) and np.all(u_arr < 1.0)):
        raise ValueError("poisson_inverse_cdf: uniforms must lie in the open interval (0, 1)")
    if lam_arr.size and not (np.all(np.isfinite(lam_arr)) and np.all(lam_arr > 0.0)):
        raise ValueError("poisson_inverse_cdf: rates (lambda) must be finite and > 0")
    return u_arr, lam_arr


def poisson_inverse_cdf(u, lam) -> np.ndarray:
    """Smallest k >= 0 with P(Poisson(lam) <= k) >= u, elementwise (u and lam broadcast against each other).

    Exact inversion: the CDF is accumulated term by term, each pmf term computed directly in log space
    (exp(k ln lam - lam - ln k!)), so a large rate does not underflow the recursion. Only the entries still
    searching are carried from one k to the next. Returns int64 with the broadcast shape.
    """
    u_arr, lam_arr = _validated_uniforms_and_rates(u, lam)
    result = np.zeros(u_arr.shape, dtype=np.int64)
    if u_arr.size == 0:
        return result
    flat_u, flat_lam = u_arr.ravel(), lam_arr.ravel()
    flat_out = result.reshape(-1)
    active = np.arange(flat_u.size)
    cdf = np.zeros(flat_u.size, dtype=np.float64)
    log_lam = np.log(flat_lam)
    lam_max = float(flat_lam.max())
    k_cap = int(math.ceil(lam_max + _TAIL_SIGMAS * math.sqrt(lam_max) + _TAIL_SLACK))
    for k in range(k_cap + 1):
        cdf = cdf + np.exp(k * log_lam[active] - flat_lam[active] - math.lgamma(k + 1))
        found = flat_u[active] <= cdf
        flat_out[active[found]] = k
        active, cdf = active[~found], cdf[~found]
        if active.size == 0:
            return result
    # Rounding left the accumulated CDF a few ulps below u: the true quantile is in the negligible tail.
    flat_out[active] = k_cap
    return result


def lognormal_log_mean(mean: float, sigma: float) -> float:
    """Location m of LogNormal(m, sigma) whose mean is `mean`: m = ln(mean) - sigma^2 / 2."""
    return math.log(mean) - 0.5 * sigma * sigma


def lognormal_from_uniform(u, mean: float, sigma: float) -> np.ndarray:
    """LogNormal draws with the given mean and log-scale sigma, by inverse CDF of uniforms in (0, 1)."""
    z = ndtri(np.asarray(u, dtype=np.float64))
    return np.exp(lognormal_log_mean(mean, sigma) + sigma * z)


def poisson_at_least_one_moments(lam: float) -> tuple[float, float]:
    """Mean and variance of T = max(X, 1), X ~ Poisson(lam).

    T = X + [X = 0], so E[T] = lam + e^-lam and E[T^2] = E[X^2] + P(X = 0) = lam + lam^2 + e^-lam.
    """
    p_zero = math.exp(-lam)
    mean = lam + p_zero
    second = lam + lam * lam + p_zero
    return mean, second - mean * mean


def lognormal_poisson_plus_one_moments(lam: float, sigma: float) -> tuple[float, float]:
    """Mean and variance of T = Poisson(tau) + 1 with tau ~ LogNormal of mean lam and log-scale sigma.

    E[T] = E[tau] + 1 = lam + 1. Law of total variance: Var T = E[Var(X | tau)] + Var(E[X | tau])
    = E[tau] + Var(tau) = lam + lam^2 (e^{sigma^2} - 1).
    """
    return lam + 1.0, lam + lam * lam * math.expm1(sigma * sigma)
