"""isoFLOP fits: per compute budget C, a parabola of the loss in log mu_rec (and in log D) whose vertex is the
budget's optimum mu*(C) (D*(C)); then the power laws mu* = k_mu C^gamma_mu and D* = k_D C^gamma_D by least squares
in log-log, stated by gamma and the optimum at the reference budget C_ref (the geometric mean of the budgets,
where the fit pins the optimum best: mu_ref = mu*(C_ref), D_ref = D*(C_ref)). Points belong to one budget when their FLOPs agree to 3 significant digits. Intervals: the points are
resampled with replacement within each budget (seeded) and everything refitted; percentile intervals.
"""
from __future__ import annotations

import numpy as np

from megaloop.laws.fit import FitError

MIN_PER_BUDGET = 3
MIN_BUDGETS = 2


def budgets(flops: np.ndarray) -> list[np.ndarray]:
    """Index arrays of the points of each compute budget (FLOPs equal to 3 significant digits), by budget."""
    keys = np.array([float(f"{f:.3g}") for f in flops])
    return [np.flatnonzero(keys == k) for k in np.unique(keys)]


def vertex(log_x: np.ndarray, loss: np.ndarray) -> float:
    """The log x where the least-squares parabola through (log_x, loss) is lowest (nan if it opens downwards, or
    if fewer than 3 distinct x define no parabola: a bootstrap resample of a budget's few points often repeats one)."""
    if len(np.unique(log_x)) < MIN_PER_BUDGET:
        return float("nan")
    a, b, _ = np.polyfit(log_x, loss, 2)
    return -b / (2 * a) if a > 0 else float("nan")


def _power_law(log_c: np.ndarray, log_opt: np.ndarray, log_ref: float) -> tuple[float, float]:
    """(gamma, the optimum at C_ref) of log opt = log k + gamma log C."""
    ok = np.isfinite(log_opt)
    if ok.sum() < MIN_BUDGETS:
        return float("nan"), float("nan")
    gamma, log_k = np.polyfit(log_c[ok], log_opt[ok], 1)
    return float(gamma), float(np.exp(log_k + gamma * log_ref))


def _fit_once(cols: dict, groups: list[np.ndarray], axes: dict, log_ref: float) -> dict:
    log_c = np.log([cols["flops"][g].mean() for g in groups])
    out = {}
    for tag, column in axes.items():
        log_opt = np.array([vertex(np.log(cols[column][g]), cols["loss"][g]) for g in groups])
        out[f"gamma_{tag}"], out[f"{tag}_ref"] = _power_law(log_c, log_opt, log_ref)
        out[f"opt_{tag}"] = np.exp(log_opt)
    return out


def fit_isoflop(cols: dict, *, boot: int = 200, level: float = 0.95, seed: int = 0, progress=None) -> dict:
    """{"params": {gamma_mu, mu_ref, gamma_D, D_ref: {value, ci_low, ci_high}}, "C_ref", "budgets": [{flops,
    mu_opt, D_opt}]}."""
    cols = {k: np.asarray(v, dtype=float) for k, v in cols.items()}
    axes = {tag: col for tag, col in (("mu", "mu_rec"), ("D", "tokens")) if col in cols}
    if "flops" not in cols or "loss" not in cols or not axes:
        raise FitError("the isoflop law needs columns flops, loss and mu_rec and/or tokens")
    groups = [g for g in budgets(cols["flops"]) if len(g) >= MIN_PER_BUDGET]
    if len(groups) < MIN_BUDGETS:
        raise FitError(f"too few points for the isoflop law: {len(groups)} compute budget(s) with at least "
                       f"{MIN_PER_BUDGET} points each, at least {MIN_BUDGETS} needed")
    log_ref = float(np.mean(np.log([cols["flops"][g].mean() for g in groups])))
    full = _fit_once(cols, groups, axes, log_ref)
    rng = np.random.default_rng(seed)
    names = [n for tag in axes for n in (f"gamma_{tag}", f"{tag}_ref")]
    samples = {n: [] for n in names}
    for _ in range(boot):
        resampled = [g[rng.integers(0, len(g), len(g))] for g in groups]
        one = _fit_once(cols, resampled, axes, log_ref)
        for n in names:
            samples[n].append(one[n])
        if progress is not None:
            progress(1)
    tail = 100 * (1 - level) / 2
    params = {}
    for n in names:
        s = np.array(samples[n])
        s = s[np.isfinite(s)]
        low, high = (np.percentile(s, tail), np.percentile(s, 100 - tail)) if len(s) else (np.nan, np.nan)
        params[n] = {"value": full[n], "ci_low": float(low), "ci_high": float(high)}
    table = [{"flops": float(cols["flops"][g].mean()), **{f"{tag}_opt": float(full[f"opt_{tag}"][i]) for tag in axes}}
             for i, g in enumerate(groups)]
    return {"params": params, "C_ref": float(np.exp(log_ref)), "budgets": table}
