"""The law fitters against synthetic data from known laws (megaloop.laws.synthetic, 1% multiplicative noise):

  recovery   each fitter's largest relative parameter error, and its time with 200 bootstrap resamples;
  selection  on noiseless data from each test-time form, the form `laws fit --law testtime` selects;
  coverage   in how many of --reps seeded repetitions the 95% intervals cover the true value of every parameter,
             for the exp test-time form and the parametric law (each parameter counted separately).

Usage (from the repository root): python benchmarks/law_fits.py [--reps 100] [--boot 200] [--only coverage]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaloop.laws import synthetic  # noqa: E402
from megaloop.laws.fit import fit_law  # noqa: E402
from megaloop.laws.forms import LAWS, TESTTIME_FORMS  # noqa: E402
from megaloop.laws.isoflop import fit_isoflop  # noqa: E402
from megaloop.laws.testtime import compare_forms  # noqa: E402


def _cases(rng):
    yield "parametric", LAWS["parametric"], synthetic.parametric(rng), synthetic.TRUTH["parametric"]
    yield "phi", LAWS["phi"], synthetic.phi(rng), synthetic.TRUTH["phi"]
    yield "unified", LAWS["unified"], synthetic.unified(rng), synthetic.TRUTH["unified"]
    for form in TESTTIME_FORMS:
        yield f"testtime:{form}", TESTTIME_FORMS[form], synthetic.testtime(form, rng, repeats=40), synthetic.TRUTH[form]


def recovery(boot: int) -> None:
    print(f"recovery (1% noise; relative error of each parameter; time with {boot} bootstrap resamples)")
    rng = np.random.default_rng(0)
    for name, law, cols, truth in _cases(rng):
        t0 = time.perf_counter()
        fit = fit_law(law, cols, boot=boot)
        dt = time.perf_counter() - t0
        err = {k: v / truth[k] - 1 for k, v in fit.values.items()}
        _report(name, len(cols["loss"]), err, dt)
    cols = synthetic.isoflop(rng)
    t0 = time.perf_counter()
    out = fit_isoflop(cols, boot=boot)
    dt = time.perf_counter() - t0
    truth = synthetic.isoflop_truth(out["C_ref"])
    _report("isoflop", len(cols["loss"]), {k: out["params"][k]["value"] / truth[k] - 1 for k in truth}, dt)


def _report(name, n, err, dt):
    worst = max(abs(e) for e in err.values())
    detail = ", ".join(f"{k} {e:+.2%}" for k, e in err.items())
    print(f"  {name:<20} {n:5d} points  max |err| {worst:.2%} ({'ok' if worst <= 0.02 else 'OVER 2%'})  "
          f"{dt:6.1f} s  [{detail}]", flush=True)


def selection() -> None:
    print("selection (noiseless T = 1..16, in distribution T <= 8)")
    for form, law in TESTTIME_FORMS.items():
        cols = {"T": np.arange(1, 17, dtype=float)}
        cols["loss"] = law.predict(synthetic.TRUTH[form], cols)
        chosen = compare_forms(cols, split=8, boot=0)["selected"]
        print(f"  data from {form:<11} -> selected {chosen:<11} {'ok' if chosen == form else 'WRONG'}", flush=True)


def coverage(reps: int, boot: int) -> None:
    print(f"coverage of the 95% intervals over {reps} seeded repetitions ({boot} resamples each)")
    designs = {"exp": (TESTTIME_FORMS["exp"], lambda r: synthetic.testtime("exp", r, repeats=4)),
               "parametric": (LAWS["parametric"], lambda r: synthetic.parametric(r, n=15))}
    for name, (law, draw) in designs.items():
        truth = synthetic.TRUTH[name]
        covered = dict.fromkeys(truth, 0)
        t0 = time.perf_counter()
        for seed in range(reps):
            fit = fit_law(law, draw(np.random.default_rng(1000 + seed)), boot=boot, seed=seed)
            for k, v in truth.items():
                lo, hi = fit.intervals[k]
                covered[k] += lo <= v <= hi
        dt = time.perf_counter() - t0
        print(f"  {name:<11} covered/{reps}: " + ", ".join(f"{k} {c}" for k, c in covered.items()) +
              f"   ({dt / reps:.1f} s per fit)", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--boot", type=int, default=200)
    ap.add_argument("--only", choices=("recovery", "selection", "coverage"))
    args = ap.parse_args()
    if args.only in (None, "recovery"):
        recovery(args.boot)
    if args.only in (None, "selection"):
        selection()
    if args.only in (None, "coverage"):
        coverage(args.reps, args.boot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
