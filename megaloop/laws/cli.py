"""`python -m megaloop laws fit RUN_DIR... | --points FILE.csv --law parametric|isoflop|testtime|unified|phi
[--json] [--plot PNG]`: fit a law with bootstrap intervals and print its parameters (a table, or one JSON object)."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
from data_prep.paths import LocalPath

HELP = "fit a scaling law (with bootstrap confidence intervals) to run directories or a CSV of points"
LAWS = ("parametric", "isoflop", "testtime", "unified", "phi")
TRAINING_LAWS = ("parametric", "isoflop", "phi")  # fitted to each run's point at T = mu_rec


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="laws_command", required=True)
    fit = sub.add_parser("fit", help=HELP, description=HELP + ". The CSV columns are params, mu_rec, tokens, flops, "
                         "T, loss, n_once, n_rec and r (unused ones may be absent). e.g. `python -m megaloop laws fit "
                         "runs/quickstart/train --law testtime --json`")
    fit.add_argument("run_dirs", nargs="*", type=LocalPath(as_path=True),
                     metavar="RUN_DIR", help="finished run directories")
    fit.add_argument("--points", type=Path, metavar="FILE.csv", help="a CSV of points instead of run directories")
    fit.add_argument("--law", required=True, choices=LAWS, help="the law to fit")
    fit.add_argument("--json", action="store_true", help="print one JSON object: each parameter by its name as "
                     "{value, ci_low, ci_high} (testtime: one object per form)")
    fit.add_argument("--plot", type=Path, metavar="PNG", help="also draw the points and the fit into this PNG")
    fit.add_argument("--boot", type=int, default=200, help="bootstrap resamples for the intervals (default 200)")
    fit.add_argument("--level", type=float, default=0.95, help="confidence level of the intervals (default 0.95)")
    fit.add_argument("--delta", type=float, default=None, help="Huber delta on log loss (default 1e-3)")
    fit.add_argument("--restarts", type=int, default=32, help="L-BFGS-B restarts from the best random starts")
    fit.add_argument("--seed", type=int, default=0, help="seed of the random starts and the resamples")
    fit.add_argument("--split-T", type=float, default=None, metavar="T",
                     help="testtime: the last in-distribution depth (default: the runs' mu_rec, else the median T)")


def run_laws(args) -> int:
    from megaloop.laws.fit import FitError
    from megaloop.laws.points import LawInputError

    try:
        _check_args(args)
        cols = _points(args)
        result = fit(args.law, cols, args)
    except (FitError, LawInputError) as err:
        print(f"megaloop laws: {err}", file=sys.stderr)
        return 2
    print(json.dumps(_jsonable(result), indent=2) if args.json else render(result))
    if args.plot is not None:
        from megaloop.laws.plots import plot_fit

        plot_fit(args.law, cols, result, args.plot)
        print(f"megaloop laws: plot written to {args.plot}", file=sys.stderr)
    return 0


def _check_args(args) -> None:
    from megaloop.laws.points import LawInputError

    if bool(args.points) == bool(args.run_dirs):
        raise LawInputError("give either run directories or --points FILE.csv (not both, not neither)")
    if args.boot < 0 or args.restarts < 1 or not 0 < args.level < 1:
        raise LawInputError("--boot must be >= 0, --restarts >= 1 and --level in (0, 1)")
    if args.delta is not None and not args.delta > 0:
        raise LawInputError(f"--delta must be > 0, got {args.delta}")


def _points(args) -> dict:
    from megaloop.laws.points import LawInputError, read_csv, read_run_dirs

    if args.points:
        cols = read_csv(args.points)
        where = str(args.points)
    else:
        cols = read_run_dirs(args.run_dirs)
        where = "the run directories"
        if args.law in TRAINING_LAWS:
            at_mu = cols["T"] == cols["mu_rec"]
            cols = {k: v[at_mu] for k, v in cols.items()}
    need = _needed_columns(args.law, cols)
    missing = [c for c in need if c not in cols]
    if missing:
        raise LawInputError(f"{where}: the {args.law} law needs column(s) {', '.join(missing)}")
    return cols


def _needed_columns(law: str, cols: dict) -> tuple[str, ...]:
    from megaloop.laws.forms import PARAMETRIC, PHI, UNIFIED

    if law == "isoflop":
        return ("flops", "loss") if ("mu_rec" in cols or "tokens" in cols) else ("flops", "loss", "mu_rec")
    return {"parametric": PARAMETRIC.columns, "phi": PHI.columns, "unified": UNIFIED.columns,
            "testtime": ("T", "loss")}[law]


def fit(law: str, cols: dict, args) -> dict:
    """The fit of `law` as a result dict (parameters by name, plus what was fitted how)."""
    from tqdm import tqdm

    from megaloop.laws.fit import DELTA, fit_law
    from megaloop.laws.forms import LAWS as FORMS

    delta = DELTA if args.delta is None else args.delta
    n = len(cols["loss"])
    forms = 4 if law == "testtime" else 1
    with tqdm(total=args.boot * forms, desc=f"bootstrap {law}", unit="fit", leave=False, file=sys.stderr,
              disable=None) as bar:
        if law == "isoflop":
            from megaloop.laws.isoflop import fit_isoflop

            out = fit_isoflop(cols, boot=args.boot, level=args.level, seed=args.seed, progress=bar.update)
            return {"law": law, "n_points": n, "boot": args.boot, "level": args.level, **out.pop("params"), **out}
        if law == "testtime":
            from megaloop.laws.testtime import compare_forms

            split = args.split_T
            if split is None and "mu_rec" in cols and len(np.unique(cols["mu_rec"])) == 1:
                split = float(cols["mu_rec"][0])
            out = compare_forms(cols, split, delta=delta, boot=args.boot, seed=args.seed,
                                restarts=args.restarts, progress=bar.update)
            return {"law": law, "n_points": n, "delta": delta, "boot": args.boot, "level": args.level,
                    **out.pop("forms"), **out}
        result = fit_law(FORMS[law], cols, delta=delta, restarts=args.restarts, boot=args.boot, level=args.level,
                         seed=args.seed, progress=bar.update)
    return {"law": law, "formula": FORMS[law].formula, "n_points": n, "delta": delta, "boot": args.boot,
            "level": args.level, **result.as_json()}


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, float)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    return x


def _is_param(v) -> bool:
    return isinstance(v, dict) and "value" in v and "ci_low" in v


def render(result: dict) -> str:
    """A plain-text table: parameter, value, interval."""
    level = f"{100 * result['level']:g}%"
    head = f"{result['law']} law, {result['n_points']} points, {result['boot']} bootstrap resamples"
    if "delta" in result:
        head += f", Huber delta {result['delta']:g} on log loss"
    lines = [head]
    if "formula" in result:
        lines.append(f"  L = {result['formula']}")
    params = {k: v for k, v in result.items() if _is_param(v)}
    lines += [f"  {k:>8} = {v['value']:.6g}   {level} [{v['ci_low']:.6g}, {v['ci_high']:.6g}]"
              for k, v in params.items()]
    if result["law"] == "testtime":
        lines += _render_forms(result, level)
    if result["law"] == "isoflop":
        lines.append(f"  C_ref = {result['C_ref']:.4g} FLOPs; optima per budget:")
        lines += ["    " + "  ".join(f"{k}={v:.4g}" for k, v in b.items()) for b in result["budgets"]]
    return "\n".join(lines)


def _render_forms(result: dict, level: str) -> list[str]:
    from megaloop.laws.forms import TESTTIME_FORMS

    lines = [f"  in distribution: T <= {result['split']:g}; form selected by {result['criterion']}: "
             f"{result['selected']}",
             f"  {'form':<11} {'formula':<22} {'rmse_in':>9} {'rmse_out':>9} {'rmse_all':>9}  parameters ({level})"]
    for name, law in TESTTIME_FORMS.items():
        f = result[name]
        ps = ", ".join(f"{k}={f[k]['value']:.4g} [{f[k]['ci_low']:.4g}, {f[k]['ci_high']:.4g}]" for k in law.names)
        mark = "*" if name == result["selected"] else " "
        lines.append(f" {mark}{name:<11} {law.formula:<22} {f.get('rmse_in', float('nan')):9.2e} "
                     f"{f.get('rmse_out', float('nan')):9.2e} {f['rmse_all']:9.2e}  {ps}")
    return lines
