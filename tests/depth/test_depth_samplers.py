"""Depth samplers: exact distributions (moments and pmf against closed forms), determinism, validation."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import integrate, stats

from megaloop.depth import SAMPLERS, fixed_eval_depth, make_sampler, poisson_inverse_cdf, split_depth

SEQUENCE_DRAWS = 100_000
# Per-batch samplers make one draw per step, and each step costs one keyed hash call (tens of microseconds), so
# they use fewer draws to keep the suite fast; the tolerance follows the standard error of whatever N is used.
BATCH_DRAWS_MAIN = 50_000
BATCH_DRAWS_EXTRA = 10_000
SIGMAS = 5.0


def draw_depths(sampler, n_draws: int, step: int = 7) -> np.ndarray:
    """n_draws independent depths: one global batch of n_draws sequences, or n_draws steps for per-batch samplers."""
    if sampler.granularity == "sequence":
        return sampler.sample(step, np.arange(n_draws)).T.numpy()
    return sampler.batch_depths(np.arange(n_draws))


def check_moments(sampler, depths: np.ndarray) -> None:
    """Sample mean and variance within SIGMAS standard errors of the closed forms; prints both."""
    n = depths.size
    mean_hat, var_hat = depths.mean(), depths.var(ddof=1)
    mean, var = sampler.mean(), sampler.variance()
    fourth = np.mean((depths - mean_hat) ** 4)
    se_mean = math.sqrt(var / n)
    se_var = math.sqrt(max(fourth - var_hat ** 2, 0.0) / n)
    print(f"\n{sampler.name:31s} mu_rec={sampler.mu_rec} mu_bwd={sampler.mu_bwd} N={n}: "
          f"mean {mean_hat:.5f} vs formula {mean:.5f} (se {se_mean:.5f}); "
          f"var {var_hat:.5f} vs formula {var:.5f} (se {se_var:.5f})")
    if var == 0.0:
        assert mean_hat == mean and var_hat == 0.0
        return
    assert abs(mean_hat - mean) <= SIGMAS * se_mean
    assert abs(var_hat - var) <= SIGMAS * se_var


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_moments_match_formulas_at_mu_rec_8(name):
    """mu_rec 8, mu_bwd default 4; 100k draws (50k for per-batch samplers)."""
    sampler = make_sampler(name, 8, seed=3)
    draws = BATCH_DRAWS_MAIN if sampler.granularity == "batch" else SEQUENCE_DRAWS
    check_moments(sampler, draw_depths(sampler, draws))


@pytest.mark.parametrize("mu_rec,mu_bwd", [(1, None), (2, 1), (5, 3)])
@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_moments_small_depths(name, mu_rec, mu_bwd):
    """At small mu_rec the truncation max(., 1) and the +1 of Huginn's sampler move the mean visibly."""
    sampler = make_sampler(name, mu_rec, mu_bwd, seed=11)
    draws = BATCH_DRAWS_EXTRA if sampler.granularity == "batch" else SEQUENCE_DRAWS
    check_moments(sampler, draw_depths(sampler, draws))


def test_closed_forms_against_direct_sums():
    """The closed-form moments agree with sums over the exact pmfs."""
    lam = 3.0
    ks = np.arange(0, 200)
    depth = np.maximum(ks, 1)
    pmf = stats.poisson.pmf(ks, lam)
    sampler = make_sampler("poisson-truncated-full", 3, 2)
    assert sampler.mean() == pytest.approx(np.sum(depth * pmf), rel=1e-12)
    assert sampler.variance() == pytest.approx(np.sum(depth ** 2 * pmf) - np.sum(depth * pmf) ** 2, rel=1e-10)
    huginn = make_sampler("poisson-lognormal-filling", 3, 2)
    mixture_ks = np.arange(0, 80)  # at lam = 3 the pmf is ~1e-12 at k = 80: the tail is below the tolerances
    mixed = _lognormal_poisson_pmf(lam, 0.5, mixture_ks)
    depth = mixture_ks + 1
    assert huginn.mean() == pytest.approx(np.sum(depth * mixed), rel=1e-8)
    assert huginn.variance() == pytest.approx(np.sum(depth ** 2 * mixed) - np.sum(depth * mixed) ** 2, rel=1e-6)


def _lognormal_poisson_pmf(lam: float, sigma: float, ks: np.ndarray) -> np.ndarray:
    """P(Poisson(tau) = k), tau ~ LogNormal of mean lam, by quadrature over the standard normal."""
    m = math.log(lam) - sigma ** 2 / 2

    def prob(k):
        return integrate.quad(lambda z: stats.poisson.pmf(k, math.exp(m + sigma * z)) * stats.norm.pdf(z),
                              -12, 12, limit=200)[0]
    return np.array([prob(int(k)) for k in ks])


def _check_pmf(depths: np.ndarray, expected: dict[int, float]) -> None:
    n = depths.size
    for value, p in expected.items():
        freq = np.mean(depths == value)
        assert abs(freq - p) <= SIGMAS * math.sqrt(p * (1 - p) / n) + 1e-12, (value, freq, p)


def test_truncated_full_pmf_is_exact():
    """P(T = 1) = P(X <= 1), P(T = k) = P(X = k) for k >= 2, X ~ Poisson(mu_rec)."""
    depths = draw_depths(make_sampler("poisson-truncated-full", 2, 1, seed=5), SEQUENCE_DRAWS)
    expected = {1: stats.poisson.cdf(1, 2.0)}
    expected.update({k: stats.poisson.pmf(k, 2.0) for k in range(2, 9)})
    _check_pmf(depths, expected)
    assert depths.min() == 1


def test_lognormal_filling_seq_pmf_is_exact():
    """P(T = k + 1) = E_tau[Poisson pmf(k; tau)] for Huginn's distribution drawn per sequence."""
    depths = draw_depths(make_sampler("poisson-lognormal-filling-seq", 3, 2, seed=5), SEQUENCE_DRAWS)
    ks = np.arange(0, 10)
    expected = dict(zip((ks + 1).tolist(), _lognormal_poisson_pmf(3.0, 0.5, ks)))
    _check_pmf(depths, expected)


@pytest.mark.parametrize("lam", [0.05, 1.0, 8.0, 37.5, 900.0, 2500.0])
def test_poisson_inverse_cdf_is_the_quantile(lam):
    """cdf(k - 1) < u <= cdf(k) for the returned k, including rates where exp(-lam) underflows."""
    u = np.random.default_rng(0).uniform(1e-9, 1 - 1e-9, size=2000)
    k = poisson_inverse_cdf(u, lam)
    assert k.dtype == np.int64 and k.shape == u.shape
    assert np.all(stats.poisson.cdf(k - 1, lam) < u + 1e-9)
    assert np.all(u <= stats.poisson.cdf(k, lam) + 1e-9)


def test_poisson_inverse_cdf_elementwise_rates_and_validation():
    u = np.array([0.3, 0.3, 0.99])
    lam = np.array([1.0, 20.0, 4.0])
    expected = [int(stats.poisson.ppf(x, r)) for x, r in zip(u, lam)]
    assert poisson_inverse_cdf(u, lam).tolist() == expected
    with pytest.raises(ValueError, match="open interval"):
        poisson_inverse_cdf([0.0], 1.0)
    with pytest.raises(ValueError, match="lambda"):
        poisson_inverse_cdf([0.5], 0.0)


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_depth_independent_of_microbatching_and_dp_layout(name):
    """A sequence's depth is the same whichever subset of the global batch, and in whatever order, it is asked in."""
    sampler = make_sampler(name, 8, seed=42)
    step, global_batch = 13, 256
    indices = step * global_batch + np.arange(global_batch)
    whole = sampler.sample(step, indices)
    by_index = {int(i): (int(t), int(n), int(k)) for i, t, n, k in zip(indices, whole.T, whole.n, whole.k)}
    rng = np.random.default_rng(1)
    for micro in (1, 8, 32, 64):
        shuffled = rng.permutation(indices)
        for dp in (1, 2, 4):
            for rank in range(dp):
                share = shuffled[rank::dp]
                for start in range(0, share.size, micro):
                    chunk = share[start:start + micro]
                    part = sampler.sample(step, torch.from_numpy(chunk))
                    got = [(int(t), int(n), int(k)) for t, n, k in zip(part.T, part.n, part.k)]
                    assert got == [by_index[int(i)] for i in chunk]
    again = make_sampler(name, 8, seed=42).sample(step, indices)
    assert torch.equal(again.T, whole.T)


@pytest.mark.parametrize("name", [n for n in sorted(SAMPLERS) if n != "fixed"])
def test_depth_depends_on_seed_and_step(name):
    sampler = make_sampler(name, 8, seed=0)
    other_seed = make_sampler(name, 8, seed=1)
    if sampler.granularity == "sequence":
        base = sampler.sample(0, np.arange(512)).T
        assert not torch.equal(base, sampler.sample(1, np.arange(512)).T)
        assert not torch.equal(base, other_seed.sample(0, np.arange(512)).T)
    else:
        steps = np.arange(64)
        assert not np.array_equal(sampler.batch_depths(steps), sampler.batch_depths(steps + 64))
        assert not np.array_equal(sampler.batch_depths(steps), other_seed.batch_depths(steps))
        batch = sampler.sample(3, np.arange(100))
        assert torch.all(batch.T == batch.T[0])


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_split_is_consistent(name):
    sampler = make_sampler(name, 6, 4, seed=2)
    for step in range(5):
        out = sampler.sample(step, np.arange(300))
        assert out.T.dtype == out.n.dtype == out.k.dtype == torch.int64
        assert torch.all(out.T >= 1)
        assert torch.equal(out.n + out.k, out.T)
        assert torch.equal(out.k, torch.clamp(out.T, max=4))


def test_fixed_sampler_values():
    out = make_sampler("fixed", 5, 3).sample(0, [4, 7])
    assert out.T.tolist() == [5, 5] and out.n.tolist() == [2, 2] and out.k.tolist() == [3, 3]


def test_split_depth_types():
    assert split_depth(7, 4) == (3, 4)
    assert split_depth(2, 4) == (0, 2)
    n, k = split_depth(np.array([1, 4, 9]), 4)
    assert n.tolist() == [0, 0, 5] and k.tolist() == [1, 4, 4]
    n, k = split_depth(torch.tensor([1, 4, 9]), 4)
    assert isinstance(n, torch.Tensor) and n.tolist() == [0, 0, 5] and k.tolist() == [1, 4, 4]
    with pytest.raises(ValueError, match="mu_bwd"):
        split_depth(3, -1)


def test_fixed_eval_depth_has_no_gradient_steps():
    out = fixed_eval_depth(12, 3)
    assert out.T.tolist() == [12] * 3 and out.n.tolist() == [12] * 3 and out.k.tolist() == [0] * 3


def test_default_mu_bwd_is_half_rounded_up():
    assert make_sampler("fixed", 8).mu_bwd == 4
    assert make_sampler("fixed", 7).mu_bwd == 4
    assert make_sampler("fixed", 1).mu_bwd == 1


def test_invalid_configurations_name_the_field():
    with pytest.raises(ValueError) as err:
        make_sampler("poisson", 8)
    for valid in SAMPLERS:
        assert valid in str(err.value)
    with pytest.raises(ValueError, match="mu_bwd"):
        make_sampler("poisson-truncated-full", 4, 5)
    with pytest.raises(ValueError, match="mu_rec"):
        make_sampler("poisson-truncated-full", 0)
    with pytest.raises(ValueError, match="mu_rec"):
        make_sampler("fixed", 2.5)
    with pytest.raises(ValueError, match="mu_bwd"):
        make_sampler("fixed", 4, 0)
    sampler = make_sampler("poisson-truncated-full", 4)
    with pytest.raises(ValueError, match="step"):
        sampler.sample(-1, [0])
    with pytest.raises(ValueError, match="sample_indices"):
        sampler.sample(0, [-3])
    with pytest.raises(ValueError, match="sample_indices"):
        sampler.sample(0, [[1, 2]])
