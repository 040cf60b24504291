"""Robust fit of a law and its bootstrap intervals.

Objective: sum_i Huber_delta(log L(theta; x_i) - log y_i), minimised by L-BFGS-B (scipy) with the analytic
gradient. Starts: `screen` random points drawn from each parameter's start range are scored, and the best
`restarts` are optimised roughly; the best is polished to a tight tolerance. delta = 1e-3 by default (as in Chinchilla's fit): residuals
beyond 0.1% of the loss count linearly, so an outlier run pulls the fit far less than under least squares.

Intervals: the points are resampled with replacement (`boot` times, seeded) and refitted, each refit started
from the full fit's optimum; each parameter's interval is the percentile interval
of the refits (2.5% and 97.5% for a 95% level).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import minimize

from megaloop.laws.forms import Law

DELTA = 1e-3


class FitError(ValueError):
    """A law cannot be fitted to these points (too few, or non-positive values)."""


@dataclass
class Fit:
    law: Law
    theta: np.ndarray
    objective: float
    n_points: int
    delta: float
    intervals: dict = field(default_factory=dict)  # name -> (low, high)
    boot_thetas: np.ndarray | None = None

    @property
    def values(self) -> dict[str, float]:
        return self.law.values(self.theta)

    def as_json(self) -> dict:
        out = {}
        for name, value in self.values.items():
            low, high = self.intervals.get(name, (float("nan"), float("nan")))
            out[name] = {"value": value, "ci_low": low, "ci_high": high}
        return out


def huber(r: np.ndarray, delta: float) -> tuple[np.ndarray, np.ndarray]:
    """Huber loss of residuals r and its derivative."""
    a = np.abs(r)
    small = a <= delta
    return np.where(small, 0.5 * r * r, delta * (a - 0.5 * delta)), np.where(small, r, delta * np.sign(r))


def objective(law: Law, cols: dict, log_y: np.ndarray, delta: float, weights: np.ndarray | None = None):
    """f(theta) -> (value, gradient) of the weighted Huber sum on log loss."""
    w = np.ones_like(log_y) if weights is None else weights
    cols = dict(cols)  # the terms cache their logs in it

    def f(theta):
        g, dg = law.terms(theta, cols)
        m = g.max(axis=1, keepdims=True)
        e = np.exp(g - m)
        s = e.sum(axis=1, keepdims=True)
        r = (m + np.log(s))[:, 0] - log_y
        h, dh = huber(r, delta)
        soft = e / s  # d logsumexp / d g_k
        grad = np.einsum("nk,nkp->p", (w * dh)[:, None] * soft, dg)
        return float((w * h).sum()), grad
    return f


def check_points(law: Law, cols: dict, min_points: int | None = None) -> None:
    n = len(cols["loss"])
    need = min_points if min_points is not None else len(law.params) + 1
    if n < need:
        raise FitError(f"too few points for the {law.name} law: {n} given, at least {need} needed "
                       f"({len(law.params)} parameters)")
    for name in law.columns:
        v = np.asarray(cols[name], dtype=float)
        if not np.all(np.isfinite(v)) or np.any(v <= 0):
            raise FitError(f"column {name!r} must be finite and > 0 for the {law.name} law")


def _starts(law: Law, rng: np.random.Generator, n: int) -> np.ndarray:
    lo = np.array([p.init[0] for p in law.params])
    hi = np.array([p.init[1] for p in law.params])
    return lo + (hi - lo) * rng.random((n, len(law.params)))


TOLERANCES = {"rough": {"maxiter": 200, "ftol": 1e-9, "gtol": 1e-7},  # the restarts: which basin is best
              "tight": {"maxiter": 5000, "ftol": 1e-14, "gtol": 1e-10},  # the fit: the best basin polished
              "boot": {"maxiter": 500, "ftol": 1e-12, "gtol": 1e-8}}  # a resample's refit (a small resample can be
#                                                                         degenerate: no endless polishing)


def _minimise(f, theta0: np.ndarray, bounds, mode: str = "tight") -> tuple[np.ndarray, float]:
    options = TOLERANCES[mode]
    res = minimize(f, theta0, jac=True, method="L-BFGS-B", bounds=bounds, options=options)
    return res.x, float(res.fun)


def fit_law(law: Law, cols: dict, *, delta: float = DELTA, restarts: int = 32, screen: int = 500, boot: int = 200,
            level: float = 0.95, seed: int = 0, progress=None) -> Fit:
    """The best of `restarts` L-BFGS-B runs from the best-scored of `screen` random starts, then `boot` bootstrap
    refits for the intervals (boot=0: no intervals). `progress(n)` is called after each bootstrap refit."""
    check_points(law, cols)
    cols = {k: np.asarray(v, dtype=float) for k, v in cols.items()}
    log_y = np.log(cols["loss"])
    bounds = [p.bounds for p in law.params]
    rng = np.random.default_rng(seed)
    f = objective(law, cols, log_y, delta)
    starts = _starts(law, rng, screen)
    starts = np.clip(starts, [b[0] for b in bounds], [b[1] for b in bounds])
    scores = np.array([f(s)[0] for s in starts])
    best_starts = starts[np.argsort(scores)[:restarts]]
    rough = min((_minimise(f, s, bounds, "rough") for s in best_starts), key=lambda tv: tv[1])
    theta, value = _minimise(f, rough[0], bounds)  # the best basin, polished
    out = Fit(law, theta, value, len(log_y), delta)
    if boot:
        _bootstrap(out, cols, log_y, bounds, boot, level, rng, progress)
    return out


def _bootstrap(fit: Fit, cols, log_y, bounds, boot, level, rng, progress) -> None:
    n = len(log_y)
    thetas = []
    for _ in range(boot):
        w = np.bincount(rng.integers(0, n, n), minlength=n).astype(float)  # a resample as multiplicities
        f = objective(fit.law, cols, log_y, fit.delta, w)
        thetas.append(_minimise(f, fit.theta, bounds, "boot")[0])  # a resample's optimum lies near the full fit's
        if progress is not None:
            progress(1)
    fit.boot_thetas = np.array(thetas)
    tail = 100 * (1 - level) / 2
    for i, p in enumerate(fit.law.params):
        values = np.array([p.value(t[i]) for t in thetas])
        fit.intervals[p.name] = (float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail)))
