"""Points drawn from known laws with multiplicative Gaussian noise (loss x (1 + noise x N(0, 1))): what the fitters
are checked against (tests/laws, benchmarks/law_fits.py). Each design spans the ranges where the law's terms all
matter, so that every parameter is identifiable."""
from __future__ import annotations

import numpy as np

from megaloop.laws.forms import PARAMETRIC, PHI, TESTTIME_FORMS, UNIFIED

TRUTH = {
    "parametric": {"E": 1.69, "X": 406.4, "x": 0.34, "Y": 410.7, "y": 0.28},  # Chinchilla's fit, as a plausible law
    "phi": {"E": 1.69, "X": 406.4, "x": 0.34, "Y": 410.7, "y": 0.28, "phi": 0.46},
    "unified": {"L_inf": 3.0, "Z": 2.0, "z": 1.5},
    "exp": {"L_inf": 3.0, "Z": 2.0, "z": 0.4},
    "power1p": {"L_inf": 3.0, "Z": 4.0, "z": 1.2},
    "power": {"L_inf": 3.0, "Z": 2.0, "z": 0.8},
    "pure_power": {"Z": 5.0, "z": 0.3},
    "isoflop": {"gamma_mu": 0.40, "gamma_D": 0.78},
}


def _noisy(loss: np.ndarray, noise: float, rng: np.random.Generator) -> np.ndarray:
    return loss * (1 + noise * rng.standard_normal(loss.shape))


def parametric(rng, noise=0.01, n=30) -> dict:
    N, D = np.meshgrid(np.geomspace(1e5, 1e11, n), np.geomspace(1e7, 1e13, n))
    cols = {"params": N.ravel(), "tokens": D.ravel()}
    cols["loss"] = _noisy(PARAMETRIC.predict(TRUTH["parametric"], cols), noise, rng)
    return cols


def phi(rng, noise=0.01, n=30) -> dict:
    r, n_once, D = np.meshgrid([1.0, 2.0, 4.0, 8.0], np.geomspace(1e5, 1e11, n), np.geomspace(1e7, 1e13, n))
    cols = {"r": r.ravel(), "n_once": n_once.ravel(), "n_rec": 4 * n_once.ravel(), "tokens": D.ravel()}
    cols["loss"] = _noisy(PHI.predict(TRUTH["phi"], cols), noise, rng)
    return cols


def testtime(form: str, rng, noise=0.01, t_max=32, repeats=20) -> dict:
    cols = {"T": np.repeat(np.arange(1, t_max + 1, dtype=float), repeats)}
    cols["loss"] = _noisy(TESTTIME_FORMS[form].predict(TRUTH[form], cols), noise, rng)
    return cols


def unified(rng, noise=0.01, t_max=32, repeats=10) -> dict:
    T, mu = np.meshgrid(np.arange(1, t_max + 1, dtype=float), [2.0, 4.0, 8.0, 16.0])
    cols = {"T": np.repeat(T.ravel(), repeats), "mu_rec": np.repeat(mu.ravel(), repeats)}
    cols["loss"] = _noisy(UNIFIED.predict(TRUTH["unified"], cols), noise, rng)
    return cols


def isoflop(rng, noise=0.01, budgets=9, per_budget=40, curvature=0.5) -> dict:
    """Loss a parabola in log mu_rec around mu*(C) = 2e-7 C^gamma_mu at each budget. FLOPs per token grow as
    mu^p with p = (1 - gamma_D) / gamma_mu, so log D = log C - p log mu + const: the loss is an exact parabola in
    log D too, around D*(C) = 3e-7 C^gamma_D."""
    g_mu, g_d = TRUTH["isoflop"]["gamma_mu"], TRUTH["isoflop"]["gamma_D"]
    p = (1 - g_d) / g_mu  # flops per token ~ mu^p makes D* ~ C^(1 - p gamma_mu) = C^gamma_D
    rows = []
    for c in np.geomspace(1e17, 1e21, budgets):
        mu_opt = 2e-7 * c ** g_mu
        for m in mu_opt * np.geomspace(0.25, 4, per_budget):
            loss = curvature * np.log(m / mu_opt) ** 2 + 2 + 50 * c ** -0.05
            rows.append((c, m, 3e-7 * c ** g_d * (m / mu_opt) ** -p, loss))
    c, m, d, loss = map(np.array, zip(*rows))
    return {"flops": c, "mu_rec": m, "tokens": d, "loss": _noisy(loss, noise, rng)}


def isoflop_truth(c_ref: float) -> dict:
    g_mu, g_d = TRUTH["isoflop"]["gamma_mu"], TRUTH["isoflop"]["gamma_D"]
    return {"gamma_mu": g_mu, "gamma_D": g_d, "mu_ref": 2e-7 * c_ref ** g_mu, "D_ref": 3e-7 * c_ref ** g_d}
