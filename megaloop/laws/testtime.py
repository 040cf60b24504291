"""The four test-time forms compared in and out of distribution, and the choice among them.

Each form is fitted twice: on every point (the parameters reported, with bootstrap intervals) and on the
in-distribution points only (T <= split, by default the run's mu_rec: the depths it trained at), whose prediction
of the points beyond the split is the out-of-distribution error. Errors are root-mean-square log residuals.
The form chosen is the one with the least out-of-distribution error (the in-distribution BIC when no point lies
beyond the split); forms within a tie margin of the best are resolved towards fewer parameters (so data from
Z T^-z selects pure_power, which L_inf + Z T^-z matches only with L_inf -> 0).
"""
from __future__ import annotations

import numpy as np

from megaloop.laws.fit import DELTA, FitError, check_points, fit_law
from megaloop.laws.forms import TESTTIME_FORMS

MIN_POINTS = 4
TIE = (1e-6, 0.05)  # forms whose error is within best + max(absolute, relative x best) count as tied


def rmse(law, theta, cols: dict) -> float:
    r = law.log_predict(theta, cols) - np.log(cols["loss"])
    return float(np.sqrt(np.mean(r * r)))


def compare_forms(cols: dict, split: float | None = None, *, delta: float = DELTA, boot: int = 200, seed: int = 0,
                  restarts: int = 16, screen: int = 200, progress=None) -> dict:
    """{"forms": {name: {params..., "rmse_in", "rmse_out", "bic", "n_params"}}, "selected", "split",
    "criterion"} for points with columns T and loss."""
    cols = {k: np.asarray(v, dtype=float) for k, v in cols.items()}
    if len(cols.get("loss", ())) < MIN_POINTS:
        raise FitError(f"too few points for the testtime law: {len(cols.get('loss', ()))} given, at least "
                       f"{MIN_POINTS} needed (the forms have up to 3 parameters)")
    check_points(TESTTIME_FORMS["pure_power"], cols)
    split = float(np.median(cols["T"])) if split is None else float(split)
    inside = cols["T"] <= split
    has_out = bool((~inside).any()) and inside.sum() >= MIN_POINTS
    cols_in = {k: v[inside] for k, v in cols.items()}
    cols_out = {k: v[~inside] for k, v in cols.items()}
    forms, n = {}, len(cols["loss"])
    for name, law in TESTTIME_FORMS.items():
        full = fit_law(law, cols, delta=delta, boot=boot, seed=seed, restarts=restarts, screen=screen,
                       progress=progress)
        entry = full.as_json()
        k = len(law.params)
        err = rmse(law, full.theta, cols)
        entry.update(n_params=k, rmse_all=err, bic=n * np.log(max(err, 1e-300) ** 2) + k * np.log(n))
        if has_out:
            try:
                part = fit_law(law, cols_in, delta=delta, boot=0, seed=seed, restarts=restarts, screen=screen)
                entry.update(rmse_in=rmse(law, part.theta, cols_in), rmse_out=rmse(law, part.theta, cols_out))
            except FitError:  # fewer in-distribution points than this form has parameters
                entry.update(rmse_in=float("nan"), rmse_out=float("nan"))
        forms[name] = entry
    criterion = "rmse_out" if has_out else "rmse_all"
    return {"forms": forms, "selected": select(forms, criterion), "criterion": criterion, "split": split}


def select(forms: dict, criterion: str) -> str:
    """The form with the least `criterion`, ties (TIE) resolved towards fewer parameters."""
    scores = {k: v[criterion] for k, v in forms.items() if np.isfinite(v[criterion])}
    if not scores:
        raise FitError(f"no test-time form could be scored by {criterion}")
    best = min(scores.values())
    margin = max(TIE[0], TIE[1] * best)
    tied = [k for k, s in scores.items() if s <= best + margin]
    return min(tied, key=lambda k: (forms[k]["n_params"], scores[k]))
