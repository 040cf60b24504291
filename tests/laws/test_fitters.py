"""The law fitters on synthetic data from known laws: the analytic gradients, recovery of the parameters under 1%
noise, the choice among the test-time forms, and (a cheap version of benchmarks/law_fits.py's study) the coverage
of the bootstrap intervals."""
import numpy as np
import pytest

from megaloop.laws import synthetic
from megaloop.laws.fit import FitError, fit_law, huber, objective
from megaloop.laws.forms import LAWS, PARAMETRIC, PHI, TESTTIME_FORMS, UNIFIED
from megaloop.laws.isoflop import fit_isoflop, vertex
from megaloop.laws.testtime import compare_forms


def _rel_err(values: dict, truth: dict) -> dict:
    return {k: abs(values[k] / truth[k] - 1) for k in truth}


@pytest.mark.parametrize("name", sorted(LAWS))
def test_gradient_matches_central_differences(name):
    law = LAWS[name]
    rng = np.random.default_rng(1)
    n = 40
    cols = {"params": np.geomspace(1e6, 1e9, n), "tokens": np.geomspace(1e8, 1e11, n)[::-1], "T": rng.uniform(1, 9, n),
            "mu_rec": rng.choice([2.0, 4.0], n), "n_once": np.geomspace(1e6, 1e8, n), "n_rec": np.geomspace(1e6, 1e8, n),
            "r": rng.choice([1.0, 2.0, 4.0], n), "loss": rng.uniform(2.5, 4.0, n)}
    f = objective(law, cols, np.log(cols["loss"]), delta=0.05, weights=rng.uniform(0, 2, n))
    lo = np.array([p.init[0] for p in law.params])
    hi = np.array([p.init[1] for p in law.params])
    theta = lo + (hi - lo) * rng.random(len(law.params))
    _, grad = f(theta)
    eps = 1e-6
    numeric = np.array([(f(theta + eps * e)[0] - f(theta - eps * e)[0]) / (2 * eps) for e in np.eye(len(theta))])
    np.testing.assert_allclose(grad, numeric, rtol=1e-5, atol=1e-6 * np.abs(numeric).max())


def test_huber_is_quadratic_then_linear():
    h, dh = huber(np.array([0.5e-3, -2e-3, 3e-3]), 1e-3)
    np.testing.assert_allclose(h, [0.125e-6, 1e-3 * (2e-3 - 0.5e-3), 1e-3 * (3e-3 - 0.5e-3)])
    np.testing.assert_allclose(dh, [0.5e-3, -1e-3, 1e-3])


def test_parametric_law_recovered_within_2_percent_under_1_percent_noise():
    cols = synthetic.parametric(np.random.default_rng(0), noise=0.01, n=30)
    fit = fit_law(PARAMETRIC, cols, boot=0, restarts=4, screen=200)
    assert max(_rel_err(fit.values, synthetic.TRUTH["parametric"]).values()) < 0.02, fit.values


@pytest.mark.parametrize("form", sorted(TESTTIME_FORMS))
def test_testtime_form_recovered_within_2_percent_under_1_percent_noise(form):
    cols = synthetic.testtime(form, np.random.default_rng(0), noise=0.01, repeats=40)
    fit = fit_law(TESTTIME_FORMS[form], cols, boot=0, restarts=4, screen=200)
    assert max(_rel_err(fit.values, synthetic.TRUTH[form]).values()) < 0.02, fit.values


def test_unified_and_phi_laws_recovered():
    """Noiseless small designs here (benchmarks/law_fits.py runs them at 1% noise on their full designs)."""
    cols = synthetic.unified(np.random.default_rng(0), noise=0.0, repeats=1)
    assert max(_rel_err(fit_law(UNIFIED, cols, boot=0, restarts=4, screen=200).values,
                        synthetic.TRUTH["unified"]).values()) < 1e-4
    cols = synthetic.phi(np.random.default_rng(0), noise=0.0, n=6)
    fit = fit_law(PHI, cols, boot=0, restarts=4, screen=200)
    assert max(_rel_err(fit.values, synthetic.TRUTH["phi"]).values()) < 1e-3, fit.values


def test_isoflop_exponents_recovered_within_2_percent():
    cols = synthetic.isoflop(np.random.default_rng(0), noise=0.01)
    out = fit_isoflop(cols, boot=50)
    truth = synthetic.isoflop_truth(out["C_ref"])
    for name in ("gamma_mu", "gamma_D"):
        p = out["params"][name]
        assert abs(p["value"] / truth[name] - 1) < 0.02 and p["ci_low"] < truth[name] < p["ci_high"], (name, p)
    assert len(out["budgets"]) == 9


def test_isoflop_vertex_needs_three_distinct_points():
    log_mu = np.log([1.0, 2.0, 4.0, 8.0])
    loss = 3 + 0.1 * (log_mu - np.log(3.0)) ** 2
    assert vertex(log_mu, loss) == pytest.approx(np.log(3.0))
    assert np.isnan(vertex(log_mu[[0, 0, 1, 1]], loss[[0, 0, 1, 1]]))  # a resample with two distinct mu_rec
    # four points per budget, exact parabolas: every usable resample gives the same vertices, so a tight interval
    budgets = np.repeat([1e12, 2e12, 4e12], 4)
    mu = np.tile([1.0, 2.0, 4.0, 8.0], 3)
    cols = {"flops": budgets, "mu_rec": mu, "loss": 3 + 0.1 * np.log(mu / (2 * (budgets / 2e12) ** 0.4)) ** 2}
    gamma = fit_isoflop(cols, boot=100)["params"]["gamma_mu"]
    assert gamma["value"] == pytest.approx(0.4) and gamma["ci_high"] - gamma["ci_low"] < 1e-9


def test_isoflop_needs_two_budgets_of_three_points():
    cols = synthetic.isoflop(np.random.default_rng(0), budgets=1)
    with pytest.raises(FitError, match="too few points for the isoflop law"):
        fit_isoflop(cols, boot=0)


@pytest.mark.parametrize("form", sorted(TESTTIME_FORMS))
def test_noiseless_data_selects_its_own_form(form):
    cols = {"T": np.arange(1, 17, dtype=float)}
    cols["loss"] = TESTTIME_FORMS[form].predict(synthetic.TRUTH[form], cols)
    result = compare_forms(cols, split=8, boot=0, restarts=4, screen=100)
    assert result["selected"] == form, {k: v["rmse_out"] for k, v in result["forms"].items()}
    assert result["criterion"] == "rmse_out" and result["forms"][form]["rmse_out"] < 1e-6


def test_exp_intervals_cover_the_truth_in_most_seeded_repetitions():
    """10 repetitions here; benchmarks/law_fits.py runs the 100-repetition study for exp and parametric."""
    truth = synthetic.TRUTH["exp"]
    covered = dict.fromkeys(truth, 0)
    for seed in range(10):
        fit = fit_law(TESTTIME_FORMS["exp"], synthetic.testtime("exp", np.random.default_rng(1000 + seed), repeats=4),
                      boot=40, seed=seed, restarts=2, screen=100)
        for k, v in truth.items():
            covered[k] += fit.intervals[k][0] <= v <= fit.intervals[k][1]
    assert min(covered.values()) >= 8, covered


def test_too_few_points_and_bad_values_are_fit_errors():
    cols = {"T": np.array([1.0, 2.0, 3.0]), "loss": np.array([3.0, 2.9, 2.8])}
    with pytest.raises(FitError, match="too few points for the exp law: 3 given, at least 4"):
        fit_law(TESTTIME_FORMS["exp"], cols)
    with pytest.raises(FitError, match="too few points for the testtime law"):
        compare_forms(cols)
    cols = {"T": np.arange(1.0, 6.0), "loss": np.array([3.0, 2.9, -1.0, 2.8, 2.7])}
    with pytest.raises(FitError, match="'loss' must be finite and > 0"):
        fit_law(TESTTIME_FORMS["exp"], cols)
