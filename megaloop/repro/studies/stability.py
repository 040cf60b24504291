"""(a) Stability: a learning-rate sweep of the RDM concatenation baseline, the additive injection and Parcae.

The paper's claim: only Parcae (rho(A_bar) < 1 by construction) converges across the sweep, where the unconstrained
injections (RDM's learned W_1, whose rho may exceed 1; the additive A = I, marginally stable) diverge. The sweep is
the reference's learning rate for a model of this size (8e-3 below 770M parameters, on Muon and AdamW alike; Muon
scales each matrix by sqrt(max(1, rows/cols)) itself) times 1, 4, 16, 32 and 64: the paper's rate, then rates far
above it, since a CPU-scale run (a few hundred steps of a ~1M-parameter model) meets instability only there. Each point logs per step the training loss, rho(A) and ||h_T|| (metrics.jsonl) and its loss spikes
(the trainer's spike monitor, train.on_spike=log).

Criterion: a run diverged when the trainer stopped it for non-finite gradients (train.max_consecutive_skips steps in
a row), or its final loss (the mean of the last tenth of its training losses) is not finite or is not below its
first step's loss (nothing learned); else it converged. Separately, the loop's state blew up when its largest
||h_T|| over training exceeds 100 times its first step's (the coda's norms can hide that from the loss).
"""
from __future__ import annotations

import math

from megaloop.repro.models import CONFIG, LABELS, PAPER_LR_SMALL, VARIANTS, lr_overrides
from megaloop.repro.sizes import base_overrides
from megaloop.repro.study import Point, Scale, Value

DOC = __doc__  # the corpus sweep's section text (a class body's __doc__ would be the class's docstring)
MULTIPLIERS = (1, 4, 16, 32, 64)
SMOKE_MULTIPLIERS = (1, 64)


class Stability:
    """The sweep, on the text corpus by default; the synth testbed's (h) is the same sweep at a deeper loop."""

    def __init__(self, name: str = "stability", title: str = "Stability across a learning-rate sweep",
                 config: str = CONFIG, loop: tuple[str, ...] = (), mu_rec: int = 4, base_lr: float = PAPER_LR_SMALL,
                 multipliers: tuple = MULTIPLIERS, smoke_multipliers: tuple = SMOKE_MULTIPLIERS,
                 steps: tuple[int, int] = (160, 8), sizing=base_overrides, doc: str = DOC):
        self.name, self.title, self.config, self.loop, self.mu_rec = name, title, config, loop, mu_rec
        self.base_lr, self.multipliers, self.smoke_multipliers = base_lr, multipliers, smoke_multipliers
        self.full_steps, self.smoke_steps, self.sizing, self.doc = *steps, sizing, doc

    def points(self, scale: Scale) -> list[Point]:
        steps = scale.steps(full=self.full_steps, smoke=self.smoke_steps)
        mults = self.smoke_multipliers if scale.name == "smoke" else self.multipliers
        pts = []
        for variant, sets in VARIANTS.items():
            for m in mults:
                lr = self.base_lr * m
                pts.append(Point(
                    study=self.name, name=f"{variant}-lr{lr:g}", config=self.config,
                    overrides=(*self.sizing(scale), *self.loop, *sets, *lr_overrides(lr), f"train.steps={steps}",
                               f"train.val_every={steps}", f"train.val_depths=[{self.mu_rec}]", "data.val_batches=4",
                               f"checkpoint.every={max(1, steps // 4)}", "train.on_spike=log"),
                    labels={"variant": variant, "lr": lr, "multiplier": m}))
        return pts

    # ---- analysis ----------------------------------------------------------------------------------------------
    def judge(self, runs, p: Point) -> dict:
        """The point's figures: outcome, final and first loss, max rho, max ||h_T||, spikes (all Values)."""
        steps, losses, src = runs.series(p, "train", "loss")
        tail = losses[-max(1, len(losses) // 10):]
        final = Value(sum(tail) / len(tail) if tail else math.nan, (src,),
                      how=f"mean of the last {len(tail)} training losses")
        first = Value(losses[0] if losses else math.nan, (src,), how="the first step's training loss")
        stopped = runs.outcome(p).get("outcome") == "diverged"
        diverged = stopped or not math.isfinite(final.value) or not final.value < first.value
        why = ("stopped: non-finite gradients" if stopped else "final loss not finite" if not math.isfinite(final.value)
               else "final loss >= first loss" if diverged else "")
        return {"diverged": diverged, "why": why, "final": final, "first": first,
                "rho": runs.series_value(p, "train", "rho_A", "finite_max"),
                "hT": runs.series_value(p, "train", "state_norm", "finite_max"),
                "hT0": runs.series_value(p, "train", "state_norm", "first"),
                "spikes": runs.series_value(p, "spike", "loss", "count"),
                "val": (runs.scalar(p, "summary.json", f"val.{self.mu_rec}.val_loss") if runs.has(p, "summary.json")
                        else None)}

    def analyse(self, scale: Scale, runs, out) -> None:
        pts = self.points(scale)
        res = {p.name: self.judge(runs, p) for p in pts}
        out.text(self.doc.split("\n\n", 1)[1].strip())
        rows = []
        for p in pts:
            r = res[p.name]
            rows.append([LABELS[p.labels["variant"]], f"{p.labels['lr']:g} ({p.labels['multiplier']:g}x)",
                         f"diverged ({r['why']})" if r["diverged"] else "converged", r["first"], r["final"],
                         r["val"], r["rho"], r["hT0"], r["hT"], "blew up" if self.blew_up(r) else "bounded",
                         r["spikes"]])
        out.table(["model", "lr", "outcome", "first loss", "final loss", f"val loss (T={self.mu_rec})", "max rho(A)",
                   "first ||h_T||", "max ||h_T||", "state", "spikes"], rows)
        self._verdict(pts, res, runs, out)
        self._plots(pts, runs, out)

    @staticmethod
    def blew_up(r: dict) -> bool:
        return not math.isfinite(r["hT"].value) or r["hT"].value > 100 * r["hT0"].value

    def _verdict(self, pts, res, runs, out) -> None:
        lines = []
        conv = {}
        for variant in VARIANTS:
            mine = [p for p in pts if p.labels["variant"] == variant]
            n_ok = sum(not res[p.name]["diverged"] for p in mine)
            count = runs.derived(n_ok, [res[p.name]["final"] for p in mine], "runs meeting the convergence criterion")
            total = runs.derived(len(mine), [res[p.name]["final"] for p in mine], "runs of the sweep")
            rho = runs.derived(max(res[p.name]["rho"].value for p in mine), [res[p.name]["rho"] for p in mine],
                               "max of rho(A) over the sweep")
            conv[variant] = (n_ok, len(mine))
            blown = runs.derived(sum(self.blew_up(res[p.name]) for p in mine),
                                 [v for p in mine for v in (res[p.name]["hT"], res[p.name]["hT0"])],
                                 "runs whose max ||h_T|| exceeds 100x the first step's")
            lines.append(f"- {LABELS[variant]}: converged in {out.num(count, 'g')} of {out.num(total, 'g')} runs; "
                         f"max rho(A) over the sweep {out.num(rho, '.4g')}; the state blew up in "
                         f"{out.num(blown, 'g')}.")
        out.text("\n".join(lines))
        blew = {v: [p for p in pts if p.labels["variant"] == v and self.blew_up(res[p.name])] for v in VARIANTS}
        if not blew["parcae"] and (blew["rdm"] or blew["additive"]):
            out.text("The loop's state: Parcae's ||h_T|| stayed bounded at every learning rate, while the "
                     "unconstrained injections' blew up at some (see the state column): the instability the paper "
                     "describes, even where the coda's norms kept the loss itself falling.")
        parcae_all = conv["parcae"][0] == conv["parcae"][1]
        others_fail = any(conv[v][0] < conv[v][1] for v in ("rdm", "additive"))
        if parcae_all and others_fail:
            out.text("**Agrees with the paper**: Parcae converged at every learning rate of the sweep, while an "
                     "unconstrained injection diverged at some.")
        elif parcae_all:
            blown = [LABELS[v] for v in VARIANTS if blew[v]]
            state = (f"The loop's state did blow up without the loss diverging, for {', '.join(blown)} (the state "
                     f"column)" + ("; for Parcae too: rho(A) < 1 bounds only the injection's linear map, and the "
                                   "core's residual update is not contracting, so at the highest learning rate it "
                                   "grew Parcae's state as well" if blew["parcae"] else "") + "."
                     if blown else "||h_T|| stayed bounded for every injection as well.")
            out.text("**Does not reproduce the divergence**: at this scale every injection converged across the "
                     "sweep, so the claim that only Parcae converges is not tested here. Likely cause: the runs are "
                     f"short ({self._steps(pts)} steps) of a small model (mu_rec {self.mu_rec}), and Muon's "
                     "orthogonalised updates bound each step's change of W_1, so rho(A) of the RDM injection has "
                     "little time to grow past 1; the paper's divergences appear at 100M+ parameters over thousands "
                     f"of steps. {state} The mechanism is visible in the table all the same: Parcae's rho(A) stays "
                     "below 1 by construction, the additive injection's is exactly 1 and the RDM injection's is not "
                     "bounded.")
        else:
            out.text("**Disagrees with the paper**: Parcae did not converge at every learning rate of the sweep "
                     "(see the table); at this scale the instability of the highest learning rates is not only the "
                     "injection's (the blocks and the optimizer can diverge on their own).")

    @staticmethod
    def _steps(pts) -> str:
        return next(o.split("=")[1] for o in pts[0].overrides if o.startswith("train.steps="))

    def _plots(self, pts, runs, out) -> None:
        from megaloop.repro.studies.plotting import new_figure, save

        for field, label, log in (("loss", "training loss", False), ("state_norm", "||h_T||", True),
                                  ("rho_A", "rho(A)", False)):
            fig, axes = new_figure(len(VARIANTS), width=4.2)
            used = []
            for ax, variant in zip(axes, VARIANTS):
                for p in (q for q in pts if q.labels["variant"] == variant):
                    steps, values, src = runs.series(p, "train", field)
                    ax.plot(steps, values, label=f"lr {p.labels['lr']:g}")
                    used.append(Value(values[-1] if values else math.nan, (src,), how=f"{field} over training"))
                ax.set_title(LABELS[variant])
                ax.set_xlabel("step")
                ax.set_ylabel(label)
                if log:
                    ax.set_yscale("log")
                ax.legend(fontsize=7)
            path = out.figure(field, f"{label} over training, per learning rate", used)
            save(fig, path)


STUDY = Stability()
