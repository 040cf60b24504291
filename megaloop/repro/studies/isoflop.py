"""(d) isoFLOP: at each of a few compute budgets, Parcae models at mu_rec in {1, 2, 4, 8} trained on as many tokens as
the budget buys; the loss at each budget is a parabola in log mu_rec (and in log D) whose vertex is the budget's
optimum, and the optima follow power laws mu* ~ C^gamma_mu, D* ~ C^gamma_D (paper: gamma_mu = 0.40, gamma_D = 0.78).

The steps of each point come from the isoFLOP grid of the Slurm sweep (slurm.sweep.grid: steps = round(budget /
FLOPs-per-token / tokens-per-step)), the FLOPs per token from megaloop's FLOP model at each mu_rec, as
`python -m megaloop flops CONFIG --json` prints them (the paper's recipe: mu_bwd = ceil(mu_rec / 2)).
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megaloop.repro.study import Artifacts, Point, Scale, Value, Writer

REPO = Path(__file__).resolve().parents[3]
CONFIG = "configs/parcae-tiny.yaml"
PAPER = {"gamma_mu": 0.40, "gamma_D": 0.78}


@dataclass(frozen=True)
class Size:
    model: tuple[str, ...]     # overrides of the model and batch, every point
    mu_values: tuple[int, ...]
    budgets: tuple[float, ...]  # training FLOPs (megaloop convention: useful FLOPs at the nominal depth mu_rec);
    #                             full: times Scale.budget where the scale has one (--budget-minutes)
    boot: int                   # bootstrap resamples of the isoFLOP fit
    base_steps: tuple[int, ...] = ()  # instead of budgets: the FLOPs of these many steps at the smallest mu_rec
    #                                   (smoke: whatever rows and vocabulary the scale's shards have)


SIZES = {
    "smoke": Size(("model.d_model=32", "model.n_heads=2", "data.micro_batch_size=4", "data.global_batch_size=4",
                   "data.val_batches=2"),
                  (1, 2, 4), (), 50, (20, 40)),
    "full": Size(("data.global_batch_size=8",), (1, 2, 4, 8), (3e11, 6e11, 1.2e12), 500),
}

# every point: the paper's truncated backprop (mu_bwd = ceil(mu_rec / 2)); one validation, at the end, at T = mu_rec
FIXED = ("model.mu_bwd=null",)
FLOPS_TOLERANCE = 0.5  # a point's trained FLOPs are within half a step of its budget (steps are whole)


def data_shape(scale: Scale) -> tuple[str, ...]:
    """The scale's shards fix the vocabulary and the row length (the runner sets them on every point first); the
    FLOPs per token depend on both, so the points name them too."""
    return tuple(f"model.{k}={getattr(scale, k)}" for k in ("vocab_size", "seq_len") if hasattr(scale, k))


def flop_costs(config: str, overrides: tuple[str, ...], mu_values: tuple[int, ...]) -> dict:
    """mu_rec -> slurm.ask.Cost from megaloop's FLOP model: the record `python -m megaloop flops --json` prints."""
    from megaloop.config import load_config
    from megaloop.train.flops_cli import flops_report
    from slurm.ask import Cost

    out = {}
    for mu in mu_values:
        cfg = load_config(REPO / config, [*overrides, f"model.mu_rec={mu}"], validate=False)
        r = flops_report(cfg, None, "megaloop", "full")
        out[mu] = Cost(float(r["flops_per_token"]), int(r["tokens_per_step"]), int(r["mu_bwd"]))
    return out


@dataclass(frozen=True)
class Metric:
    """What an isoFLOP point is judged by: `read` gives the point's number (lower is better), `label` names it in
    tables and axes, `describe` in the text; `evaluation` is what the point's Point adds to be evaluated for it."""

    read: object        # (runs, point) -> Value
    label: str
    describe: str
    evaluation: object = None  # (scale, mu_rec) -> dict of Point fields (and "labels" to add), or None: the
    #                            trainer's validation


VAL_LOSS = Metric(lambda runs, p: runs.scalar(p, "summary.json", f"val.{p.labels['mu_rec']}.val_loss"),
                  "val loss at T = mu_rec", "each run's final validation loss at T = mu_rec")


class IsoFlopStudy:
    """The isoFLOP grid on the text corpus by default; the synth testbed's (i) judges its points by answer loss."""

    def __init__(self, name: str = "isoflop", title: str = "isoFLOP: the compute-optimal loop count",
                 config: str = CONFIG, sizes: dict = SIZES, metric: Metric = VAL_LOSS):
        self.name, self.title, self.config, self.sizes, self.metric = name, title, config, sizes, metric

    def points(self, scale: Scale) -> list[Point]:
        from slurm.sweep import grid

        size = self.sizes[scale.name]
        base = (*data_shape(scale), *size.model, *FIXED)
        costs = flop_costs(self.config, base, size.mu_values)
        budgets = [b * (getattr(scale, "budget", 1.0) if scale.name == "full" else 1.0) for b in size.budgets]
        low = costs[min(size.mu_values)]
        budgets += [float(f"{n * low.flops_per_token * low.tokens_per_step:.3g}") for n in size.base_steps]
        out = []
        for g in grid(list(size.mu_values), budgets, costs, "", FIXED):
            extra = tuple(o for o in g.overrides if o not in FIXED)  # model.mu_rec, train.steps
            extra_fields = dict(self.metric.evaluation(scale, g.mu_rec)) if self.metric.evaluation else {}
            more_labels = extra_fields.pop("labels", {})
            out.append(Point(self.name, Path(g.out_dir).name, self.config,
                             (*base, *extra, f"train.val_every={g.steps}", f"train.val_depths=[{g.mu_rec}]"),
                             labels={"mu_rec": g.mu_rec, "budget": g.budget, "steps": g.steps,
                                     "flops_per_token": g.flops_per_token, "tokens_per_step": g.tokens_per_step,
                                     "mu_bwd": g.mu_bwd, **more_labels}, **extra_fields))
        return out

    def analyse(self, scale: Scale, runs: Artifacts, out: Writer) -> None:
        write_section(self.points(scale), self.sizes[scale.name].boot, runs, out, self.config, self.metric)


def read_point(runs: Artifacts, p: Point, metric: Metric = VAL_LOSS) -> dict[str, Value]:
    """One finished point: its metric (by default the final validation loss at T = mu_rec), its trained tokens, its
    useful FLOPs (the depths it sampled) and its nominal FLOPs (trained tokens x FLOPs per token at T = mu_rec, what
    the budget buys)."""
    tokens = runs.scalar(p, "summary.json", "tokens")
    fpt = p.labels["flops_per_token"]
    return {"loss": metric.read(runs, p), "tokens": tokens,
            "useful": runs.scalar(p, "summary.json", "useful_flops"),
            "mu_rec": runs.scalar(p, "config.json", "model.mu_rec"),
            "nominal": runs.derived(tokens.value * fpt, [tokens],
                                    f"trained tokens x {fpt:.6g} FLOPs per token at T = mu_rec (FLOP model)")}


def budget_groups(points: list[Point]) -> dict[float, list[Point]]:
    groups: dict[float, list[Point]] = {}
    for p in points:
        groups.setdefault(p.labels["budget"], []).append(p)
    return dict(sorted(groups.items()))


def write_section(points: list[Point], boot: int, runs: Artifacts, out: Writer, config: str = CONFIG,
                  metric: Metric = VAL_LOSS) -> None:
    from megaloop.laws.fit import FitError
    from megaloop.laws.isoflop import fit_isoflop

    groups = budget_groups(points)
    data = {p.name: read_point(runs, p, metric) for p in points}
    out.text(f"Parcae models ({config}, mu_bwd = ceil(mu_rec / 2)) at mu_rec in "
             f"{{{', '.join(str(m) for m in sorted({p.labels['mu_rec'] for p in points}))}}}, each trained on the "
             f"tokens its FLOP budget buys at its mu_rec (steps = round(budget / FLOPs-per-token / tokens-per-step), "
             f"the Slurm isoFLOP sweep's rule; FLOPs per token from `python -m megaloop flops`). The loss is "
             f"{metric.describe}.")
    budget_of = {}  # point name -> the Value of its budget (the mean nominal FLOPs of its group)
    for budget, group in groups.items():
        nominal = [data[p.name]["nominal"] for p in group]
        c = runs.derived(float(np.mean([v.value for v in nominal])), nominal,
                         "mean nominal training FLOPs of the budget's points")
        for p in group:
            budget_of[p.name] = c
    rows = []
    for p in points:
        d = data[p.name]
        off = runs.derived(d["nominal"].value / budget_of[p.name].value - 1, [d["nominal"], budget_of[p.name]],
                           "nominal FLOPs / the budget's mean - 1")
        rows.append([f"{p.labels['budget']:.3g}", d["mu_rec"], str(p.labels["steps"]), d["tokens"], d["nominal"],
                     off, d["useful"], d["loss"]])
    out.table(["budget", "mu_rec", "steps", "tokens D", "nominal FLOPs", "off budget", "useful FLOPs (sampled T)",
               metric.label], rows)
    cols = {"flops": [budget_of[p.name].value for p in points], "mu_rec": [data[p.name]["mu_rec"].value for p in points],
            "tokens": [data[p.name]["tokens"].value for p in points], "loss": [data[p.name]["loss"].value for p in points]}
    inputs = [v for p in points for v in (data[p.name]["loss"], data[p.name]["tokens"], budget_of[p.name])]
    try:
        with warnings.catch_warnings():  # a resample that repeats a point makes polyfit warn; its vertex still counts
            warnings.simplefilter("ignore", np.exceptions.RankWarning)
            fit = fit_isoflop(cols, boot=boot, seed=0)
    except FitError as err:
        out.text(f"Not enough points for the isoFLOP fit: {err}.")
        return
    _budget_table(fit, groups, data, budget_of, runs, out)
    params = _params_table(fit, inputs, runs, out)
    _figures(fit, groups, data, budget_of, params, out, metric.label)
    _verdict(fit, groups, data, budget_of, params, runs, out)


def _ci(fit: dict, name: str, inputs: list[Value], runs: Artifacts, how: str) -> tuple[Value, Value, Value]:
    p = fit["params"][name]
    return tuple(runs.derived(p[k], inputs, f"{how}{'' if k == 'value' else f' ({k}, bootstrap)'}")
                 for k in ("value", "ci_low", "ci_high"))


def _fmt_ci(out: Writer, v: Value, lo: Value, hi: Value, fmt: str = ".3g") -> str:
    if not np.isfinite(v.value):
        return "n/a (no vertex)"
    bounds = f" [{out.num(lo, fmt)}, {out.num(hi, fmt)}]" if np.isfinite(lo.value) else " [interval n/a]"
    return f"{out.num(v, fmt)}{bounds}"


def _budget_table(fit, groups, data, budget_of, runs, out) -> None:
    rows = []
    for (budget, group), b in zip(groups.items(), fit["budgets"]):
        ins = [v for p in group for v in (data[p.name]["loss"], data[p.name]["tokens"])] + [budget_of[group[0].name]]
        best = min(group, key=lambda p: data[p.name]["loss"].value)
        cells = [f"{budget:.3g}", budget_of[group[0].name]]
        for tag, col in (("mu", "mu_rec"), ("D", "tokens")):
            opt = b[f"{tag}_opt"]
            cells.append(runs.derived(opt, ins, f"vertex of the parabola of loss in log {col} at this budget")
                         if np.isfinite(opt) else "no vertex (parabola opens downwards)")
        cells += [data[best.name]["mu_rec"], data[best.name]["loss"]]
        rows.append(cells)
    out.text("Per budget: the vertex of the least-squares parabola of the loss in log mu_rec (mu*) and in log D "
             "(D*), and the best measured point.")
    out.table(["budget", "mean nominal FLOPs C", "mu* (vertex)", "D* (vertex, tokens)", "best measured mu_rec",
               "its loss"], rows)


def _params_table(fit, inputs, runs, out) -> dict:
    hows = {"gamma_mu": "exponent of mu* = k C^gamma_mu (least squares in log-log over the budgets' vertices)",
            "mu_ref": "mu* at C_ref (the power law of mu*)",
            "gamma_D": "exponent of D* = k C^gamma_D (least squares in log-log over the budgets' vertices)",
            "D_ref": "D* at C_ref (the power law of D*)"}
    params = {n: _ci(fit, n, inputs, runs, h) for n, h in hows.items() if n in fit["params"]}
    c_ref = runs.derived(fit["C_ref"], inputs, "geometric mean of the budgets")
    rows = [["gamma_mu (mu* ~ C^gamma_mu)", _fmt_ci(out, *params["gamma_mu"]), "0.40"],
            ["mu* at C_ref", _fmt_ci(out, *params["mu_ref"]), "-"],
            ["gamma_D (D* ~ C^gamma_D)", _fmt_ci(out, *params["gamma_D"]), "0.78"],
            ["D* at C_ref (tokens)", _fmt_ci(out, *params["D_ref"]), "-"]]
    out.text(f"Power laws of the optima over the budgets (C_ref = {out.num(c_ref, '.3g')} FLOPs); 95% percentile "
             f"intervals from resampling the points within each budget.")
    out.table(["quantity", "fitted [95% interval]", "paper"], rows)
    return params


def _figures(fit, groups, data, budget_of, params, out, ylabel: str = VAL_LOSS.label) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    sources = [v for d in data.values() for v in (d["loss"], d["tokens"])]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), dpi=110)
    for (budget, group), b in zip(groups.items(), fit["budgets"]):
        for ax, col, tag in ((axes[0], "mu_rec", "mu"), (axes[1], "tokens", "D")):
            x = np.array([data[p.name][col].value for p in group])
            y = np.array([data[p.name]["loss"].value for p in group])
            line = ax.plot(x, y, "o", label=f"C = {budget:.3g}")[0]
            if len(x) >= 3:
                coef = np.polyfit(np.log(x), y, 2)
                grid = np.geomspace(x.min(), x.max(), 100)
                ax.plot(grid, np.polyval(coef, np.log(grid)), "-", color=line.get_color())
            opt = b[f"{tag}_opt"]
            if np.isfinite(opt) and x.min() / 2 <= opt <= 2 * x.max():  # a vertex far off the grid: in the table
                ax.axvline(opt, ls=":", color=line.get_color())
    axes[0].set(xscale="log", xlabel="mu_rec", ylabel=ylabel, title="isoFLOP curves in mu_rec")
    axes[1].set(xscale="log", xlabel="training tokens D", title="isoFLOP curves in D")
    c = np.array([b["flops"] for b in fit["budgets"]])
    for tag, label, paper in (("mu", "mu*", 0.40), ("D", "D*", 0.78)):
        opt = np.array([b[f"{tag}_opt"] for b in fit["budgets"]])
        g, ref = params[f"gamma_{tag}"][0].value, params[f"{tag}_ref"][0].value
        pts = axes[2].loglog(c, opt / ref, "o", label=f"{label} / {label}(C_ref)")[0]
        if np.isfinite(g):
            axes[2].loglog(c, (c / fit["C_ref"]) ** g, "-", color=pts.get_color(), label=f"fit: C^{g:.2f}")
        axes[2].loglog(c, (c / fit["C_ref"]) ** paper, "--", color=pts.get_color(), alpha=0.5,
                       label=f"paper: C^{paper}")
    axes[2].set(xlabel="training FLOPs C", ylabel="optimum / optimum at C_ref", title="optima against compute")
    mus = sorted({p.labels["mu_rec"] for g in groups.values() for p in g})
    axes[0].set_xticks(mus, [str(m) for m in mus])
    axes[2].set_xticks(c, [f"{v:.2g}" for v in c])
    for ax in axes:
        if ax is axes[1]:  # a log axis spanning less than a decade: ticks at 1, 2, 5 x 10^k, labelled
            ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.2g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out.figure("isoflop", "Left, middle: loss against mu_rec and against tokens at each budget, with the "
                      "parabolas in log x and their vertices (dotted). Right: the optima against compute, the fitted "
                      "power laws and the paper's exponents (dashed).", sources)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def _verdict(fit, groups, data, budget_of, params, runs, out) -> None:
    cs = sorted({id(v): v for v in budget_of.values()}.values(), key=lambda v: v.value)
    span = runs.derived(cs[-1].value / cs[0].value, [cs[0], cs[-1]], "largest budget / smallest budget")
    mus = sorted({p.labels["mu_rec"] for p in sum(groups.values(), [])})
    edge = [f"{b['flops']:.3g}" for b in fit["budgets"]
            if not np.isfinite(b["mu_opt"]) or not mus[0] <= b["mu_opt"] <= mus[-1]]
    best = {b: min(g, key=lambda p: data[p.name]["loss"].value) for b, g in groups.items() if len(g) >= 3}
    at_edge = bool(best) and all(p.labels["mu_rec"] == mus[0] for p in best.values())
    lines = []
    for name, (v, lo, hi), paper in (("gamma_mu", params["gamma_mu"], 0.40), ("gamma_D", params["gamma_D"], 0.78)):
        if not np.isfinite(v.value):
            lines.append(f"- {name}: no estimate (fewer than two budgets have a parabola that opens upwards).")
        elif np.isfinite(lo.value) and lo.value <= paper <= hi.value:
            verdict = ("but with every optimum at the grid's edge (below) this is no evidence either way" if at_edge
                       else "consistent, but at this width of interval not a confirmation")
            lines.append(f"- {name} = {out.num(v, '.3g')}: its interval [{out.num(lo, '.3g')}, {out.num(hi, '.3g')}] "
                         f"contains the paper's {paper}: {verdict}.")
        else:
            lines.append(f"- {name} = {out.num(v, '.3g')} [{out.num(lo, '.3g')}, {out.num(hi, '.3g')}]: disagrees "
                         f"with the paper's {paper}.")
    if edge:
        lines.append(f"- At budget(s) {', '.join(edge)} the vertex in mu_rec lies outside the measured range "
                     f"[{mus[0]}, {mus[-1]}] (or the parabola opens downwards): mu* there is an extrapolation.")
    if at_edge:
        lines.append(f"- **Disagreement with the paper**: at every budget the lowest loss is at the smallest mu_rec "
                     f"measured ({mus[0]}) (e.g. {', '.join(out.num(data[p.name]['loss']) for p in best.values())}"
                     f"), so the optimum lies at or below the edge of the grid and the vertices and their exponent "
                     f"rest on the parabolas' extrapolation. The paper finds an optimum inside its grid, growing "
                     f"with C. Likely cause: these runs are tens to a hundred-odd steps long, a deeper loop costs "
                     f"more FLOPs per token and so trains on fewer tokens and takes fewer steps at the same budget, "
                     f"and this early in training the number of updates decides the loss; the depth pays only once "
                     f"the data term is no longer dominant, far beyond these budgets.")
    spreads = []
    for g in groups.values():
        tok = sorted((data[p.name]["tokens"] for p in g), key=lambda v: v.value)
        spreads.append(runs.derived(tok[-1].value / tok[0].value, [tok[0], tok[-1]],
                                    "most / fewest tokens within one budget"))
    d_spread = max(spreads, key=lambda v: v.value)
    lines += _optimum_moves(groups, data, mus, out)
    out.text("What this can and cannot say about the paper's exponents (mu* ~ C^0.40, D* ~ C^0.78, fitted there on "
             "isoFLOP curves of far larger models over budgets spanning orders of magnitude):\n\n"
             + "\n".join(lines) + "\n\n"
             f"- The budgets span a factor of {out.num(span, '.3g')} in compute, not orders "
             f"of magnitude: over so short a lever arm a small error in each budget's vertex moves the slope a lot, "
             f"and the bootstrap interval covers only the scatter of these few points, not the model's "
             f"systematic errors (below).\n"
             + _token_trade(d_spread, mus, out) +
             "- Each run is short (tens to a few hundred steps): the losses compared are early-training losses, "
             "where learning-rate warmup and the optimizer's momentum warmup weigh as much as the model's shape; the "
             "paper's runs are trained far past that.\n"
             "- Hence a CPU-scale gamma_mu is at best a sign (whether the optimal loop count grows with compute), not "
             "a measurement of 0.40.")


def _token_trade(d_spread: Value, mus: list[int], out: Writer) -> str:
    """The bullet on how much a deeper loop costs in tokens at a fixed budget (D* is informative only if it varies)."""
    if d_spread.value < 2:
        return (f"- At this width the terms that do not grow with depth (prelude, coda, and the tied head over the "
                f"vocabulary) dominate the FLOPs per token, so at a fixed budget the token count changes only by a "
                f"factor of at most {out.num(d_spread, '.2g')} from mu_rec = {mus[0]} to {mus[-1]}: D* is nearly "
                f"fixed by C (D ~ C), which pulls gamma_D towards 1 by construction, not because of looping. In the "
                f"paper the loop dominates the FLOPs, so trading depth for tokens is a real trade-off.\n")
    return (f"- At a fixed budget the token count changes by a factor of up to {out.num(d_spread, '.2g')} from "
            f"mu_rec = {mus[0]} to {mus[-1]}: the loop dominates the FLOPs per token, so depth is traded against "
            f"data, as in the paper.\n")


def _optimum_moves(groups: dict, data: dict, mus: list[int], out: Writer) -> list[str]:
    """Where each budget's best measured mu_rec lies in the grid, and whether it moves deeper with compute."""
    best = [(b, min(g, key=lambda p: data[p.name]["loss"].value)) for b, g in groups.items() if len(g) >= 3]
    if len(best) < 2:
        return []
    where = [f"{out.num(data[p.name]['mu_rec'], 'g')} at {b:.3g} FLOPs"
             f"{' (inside the grid)' if mus[0] < p.labels['mu_rec'] < mus[-1] else ' (an edge of the grid)'}"
             for b, p in best]
    deeper = [p.labels["mu_rec"] for _, p in best]
    sign = ("it moves to deeper loops as compute grows: the sign of the paper's gamma_mu > 0, though two budgets "
            "give no exponent" if all(a <= b for a, b in zip(deeper, deeper[1:])) and deeper[-1] > deeper[0] else
            "it does not move to deeper loops as compute grows here")
    return [f"- The best measured mu_rec per budget: {'; '.join(where)}; {sign}."]


STUDY = IsoFlopStudy()
