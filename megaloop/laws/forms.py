"""The laws, each a sum of positive terms exp(g_k(theta; data)): log L = logsumexp_k g_k.

Scale parameters (E, X, Y, Z, L_inf) are fitted as their logarithms, exponents as themselves (bounded to be
positive), so every law is a smooth function of theta with an analytic gradient. A law names its parameters as the
formulas do (E, X, x, Y, y, Z, z, L_inf, phi) and says which columns it reads.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

LOG_SCALE = (-25.0, 25.0)  # bounds on a fitted log-scale parameter
EXPONENT = (1e-6, 10.0)  # bounds on a fitted exponent


@dataclass(frozen=True)
class Param:
    name: str
    log_scale: bool  # fitted as log(value)
    init: tuple[float, float]  # the range random starts are drawn from (in the fitted coordinate)
    bounds: tuple[float, float]

    def value(self, theta_i: float) -> float:
        return float(np.exp(theta_i)) if self.log_scale else float(theta_i)


def scale(name: str, init=(-3.0, 8.0)) -> Param:
    return Param(name, True, init, LOG_SCALE)


def exponent(name: str, init=(0.05, 1.5), bounds=EXPONENT) -> Param:
    return Param(name, False, init, bounds)


# terms(theta, cols) -> (G [n, K], dG [n, K, P]): each term's log value and its gradient in theta
Terms = Callable[[np.ndarray, dict], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class Law:
    name: str
    formula: str
    params: tuple[Param, ...]
    columns: tuple[str, ...]
    terms: Terms

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.params]

    def values(self, theta: np.ndarray) -> dict[str, float]:
        return {p.name: p.value(t) for p, t in zip(self.params, theta)}

    def theta(self, values: dict[str, float]) -> np.ndarray:
        return np.array([np.log(values[p.name]) if p.log_scale else values[p.name] for p in self.params])

    def log_predict(self, theta: np.ndarray, cols: dict) -> np.ndarray:
        g, _ = self.terms(np.asarray(theta, dtype=float), cols)
        return _logsumexp(g)

    def predict(self, values: dict[str, float], cols: dict) -> np.ndarray:
        return np.exp(self.log_predict(self.theta(values), cols))


def _logsumexp(g: np.ndarray) -> np.ndarray:
    m = g.max(axis=1, keepdims=True)
    return (m + np.log(np.exp(g - m).sum(axis=1, keepdims=True)))[:, 0]


def _stack(gs: list, dgs: list) -> tuple[np.ndarray, np.ndarray]:
    return np.stack(gs, axis=1), np.stack(dgs, axis=1)


def _const(n: int, p: int, i: int) -> np.ndarray:
    d = np.zeros((n, p))
    d[:, i] = 1.0
    return d


def _decay_terms(feature: Callable[[dict], np.ndarray], floor: bool) -> Terms:
    """[L_inf +] Z exp(-z f(cols)): theta = ([log L_inf,] log Z, z)."""
    def terms(theta, cols):
        f = feature(cols)
        n, p, o = len(f), len(theta), int(floor)
        d = _const(n, p, o)
        d[:, o + 1] = -f
        gs, dgs = [theta[o] - theta[o + 1] * f], [d]
        if floor:
            gs.insert(0, np.full(n, theta[0]))
            dgs.insert(0, _const(n, p, 0))
        return _stack(gs, dgs)
    return terms


def _testtime(name: str, formula: str, feature, floor: bool = True) -> Law:
    params = ((scale("L_inf", (-1.0, 2.5)),) if floor else ()) + (scale("Z", (-3.0, 3.0)), exponent("z", (0.05, 2.0)))
    return Law(name, formula, params, ("T", "loss"), _decay_terms(feature, floor))


TESTTIME_FORMS = {
    "exp": _testtime("exp", "L_inf + Z exp(-z T)", lambda c: c["T"]),
    "power1p": _testtime("power1p", "L_inf + Z (1 + T)^-z", lambda c: np.log1p(c["T"])),
    "power": _testtime("power", "L_inf + Z T^-z", lambda c: np.log(c["T"])),
    "pure_power": _testtime("pure_power", "Z T^-z", lambda c: np.log(c["T"]), floor=False),
}

UNIFIED = Law("unified", "L_inf + Z exp(-z T / mu_rec)", TESTTIME_FORMS["exp"].params, ("T", "mu_rec", "loss"),
              _decay_terms(lambda c: c["T"] / c["mu_rec"], floor=True))


def _log(cols: dict, name: str) -> np.ndarray:
    """log of a column, cached in `cols` (the objective calls the terms thousands of times on the same points)."""
    key = "log_" + name
    if key not in cols:
        cols[key] = np.log(cols[name])
    return cols[key]


def _parametric_terms(theta, cols):
    """E + X N^-x + Y D^-y, theta = (log E, log X, x, log Y, y); N = params (the model at its mu_rec)."""
    log_n, log_d = _log(cols, "params"), _log(cols, "tokens")
    n, p = len(log_n), len(theta)
    dx, dy = _const(n, p, 1), _const(n, p, 3)
    dx[:, 2], dy[:, 4] = -log_n, -log_d
    return _stack([np.full(n, theta[0]), theta[1] - theta[2] * log_n, theta[3] - theta[4] * log_d],
                  [_const(n, p, 0), dx, dy])


PARAMETRIC = Law("parametric", "E + X N(mu_rec)^-x + Y D^-y",
                 (scale("E", (-1.0, 1.5)), scale("X", (0.0, 10.0)), exponent("x", (0.05, 1.0)),
                  scale("Y", (0.0, 10.0)), exponent("y", (0.05, 1.0))),
                 ("params", "tokens", "loss"), _parametric_terms)


def _phi_terms(theta, cols):
    """E + X (N_once + r^phi N_rec)^-x + Y D^-y, theta = (log E, log X, x, log Y, y, phi)."""
    log_r, n_once, n_rec, log_d = _log(cols, "r"), cols["n_once"], cols["n_rec"], _log(cols, "tokens")
    rp = np.exp(theta[5] * log_r)
    n_eff = n_once + rp * n_rec
    log_n = np.log(n_eff)
    n, p = len(log_r), len(theta)
    dx, dy = _const(n, p, 1), _const(n, p, 3)
    dx[:, 2] = -log_n
    dx[:, 5] = -theta[2] * rp * log_r * n_rec / n_eff
    dy[:, 4] = -log_d
    return _stack([np.full(n, theta[0]), theta[1] - theta[2] * log_n, theta[3] - theta[4] * log_d],
                  [_const(n, p, 0), dx, dy])


PHI = Law("phi", "E + X (N_once + r^phi N_rec)^-x + Y D^-y", PARAMETRIC.params + (exponent("phi", (0.0, 1.0), (0.0, 2.0)),),
          ("n_once", "n_rec", "r", "tokens", "loss"), _phi_terms)

LAWS = {"parametric": PARAMETRIC, "unified": UNIFIED, "phi": PHI, **{f"testtime:{k}": v for k, v in TESTTIME_FORMS.items()}}
