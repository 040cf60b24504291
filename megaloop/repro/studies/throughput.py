"""(e) Throughput: `megaloop bench` of the stability study's three models, useful against executed FLOPs, and what
the ragged loop and depth-balanced dealing save, each measured with the feature off and on side by side.

- bench: each model at the paper's learning rate, `megaloop bench` (2 warm-up steps, then the measured ones) with
  per-sequence depths (poisson-truncated-full). Useful FLOPs count each sequence at its own depth, executed FLOPs the
  laps that ran.
- ragged loop: one process times forward + backward of the same micro-batches (same weights, depths, tokens) with
  the ragged loop (a lap runs only the rows still looping) and with the masked loop (every row runs the micro-batch's
  deepest depth), alternating which goes first; CPU time, so that the other processes of a shared machine count
  less; core rows are exact counts.
- depth-balanced dealing: two data-parallel processes (gloo) run the same steps with parallel.dp_balance=rows (equal
  rows per rank) and depth (sequences dealt by their loop work); idle_fraction is what the trainer logs per step,
  1 - useful work / (ranks x the busiest rank's work), from the depths the model ran (not a timing).
Speed points run one at a time after the training points, with nothing else of the study on the cores.
"""
from __future__ import annotations

from megaloop.repro.models import CONFIG, LABELS, PAPER_LR_SMALL, VARIANTS, lr_overrides
from megaloop.repro.sizes import base_overrides
from megaloop.repro.study import Point, Scale

DEALINGS = ("rows", "depth")


class Throughput:
    name = "throughput"
    title = "Throughput: useful vs executed FLOPs"

    @staticmethod
    def variants(scale: Scale) -> tuple[str, ...]:
        """The benched models: the three at full scale, Parcae alone at smoke scale (its start-up dominates)."""
        return ("parcae",) if scale.name == "smoke" else tuple(VARIANTS)

    def points(self, scale: Scale) -> list[Point]:
        smoke = scale.name == "smoke"
        steps = 3 if smoke else 10
        base = (*base_overrides(scale), *lr_overrides(PAPER_LR_SMALL), "model.depth_sampler=poisson-truncated-full")
        pts = [Point(study=self.name, name=f"bench-{v}", config=CONFIG, overrides=(*base, *VARIANTS[v]), kind="bench",
                     bench_steps=steps, labels={"variant": v}) for v in self.variants(scale)]
        pts.append(Point(study=self.name, name="ragged-parcae", config=CONFIG, overrides=base, kind="ragged",
                         bench_steps=2 if smoke else 8, labels={"variant": "parcae"}))
        dp_steps = 3 if smoke else 12
        pts += [Point(study=self.name, name=f"dp2-{d}", config=CONFIG, nproc=2, kind="bench", bench_steps=dp_steps,
                      overrides=(*base, "parallel.dp=2", f"parallel.dp_balance={d}",
                                 f"data.micro_batch_size={2 if smoke else 4}"), labels={"dealing": d})
                for d in DEALINGS]
        return pts

    def analyse(self, scale: Scale, runs, out) -> None:
        pts = {p.name: p for p in self.points(scale)}
        out.text(__doc__.split("\n\n", 1)[1].strip())
        rows, used = [], []
        for v in self.variants(scale):
            p = pts[f"bench-{v}"]
            tps = runs.scalar(p, "bench.json", "tokens_per_s")
            useful = runs.scalar(p, "bench.json", "useful_tflops")
            executed = runs.scalar(p, "bench.json", "executed_tflops")
            ratio = runs.derived(useful.value / executed.value, [useful, executed], "useful / executed TFLOP/s")
            rows.append([LABELS[v], tps, useful, executed, ratio, runs.scalar(p, "bench.json", "step_s")])
            used += [tps, ratio]
        out.text("**Bench** (one process; wall time of a shared machine: compare within the table, not across "
                 "machines):")
        out.table(["model", "tokens/s", "useful TFLOP/s", "executed TFLOP/s", "useful/executed", "s/step"], rows)
        out.text("useful/executed is 1 when every lap that ran was some sequence's own (the trainer's ragged loop "
                 "over depth-bucketed micro-batches); below it, the laps run past a sequence's depth. What the "
                 "masked loop would have executed instead is measured next.")
        self._ragged(pts["ragged-parcae"], runs, out)
        self._dealing(pts, runs, out)
        self._plot(pts, self.variants(scale), runs, out)

    def _ragged(self, p: Point, runs, out) -> None:
        useful = runs.scalar(p, "ragged.json", "useful_core_rows")
        ragged = runs.scalar(p, "ragged.json", "ragged_core_rows")
        masked = runs.scalar(p, "ragged.json", "masked_core_rows")
        saved = runs.derived(1 - ragged.value / masked.value, [ragged, masked], "1 - ragged / masked core rows")
        speed = runs.scalar(p, "ragged.json", "speedup")
        out.text(f"**Ragged loop** (Parcae, per-sequence depths): the masked loop ran {out.num(masked, 'g')} core "
                 f"rows for {out.num(useful, 'g')} useful ones; the ragged loop ran {out.num(ragged, 'g')}, "
                 f"{out.num(saved, '.1%')} fewer. Forward + backward per CPU-second: ragged / masked = "
                 f"{out.num(speed, '.3g')}x (the prelude, coda and head run the same in both, so the speed-up is "
                 "below the saved share of core rows)."
                 + ("" if speed.value >= 1 else " Below 1 here: at this width a lap is so cheap that the ragged "
                    "loop's bookkeeping (rows sorted by depth, a slice per lap) costs more than the laps it skips; "
                    "the rows it saves are what counts at model sizes where a lap's matmuls dominate."))

    def _dealing(self, pts: dict, runs, out) -> None:
        idle = {d: runs.series_value(pts[f"dp2-{d}"], "train", "idle_fraction", "mean") for d in DEALINGS}
        tps = {d: runs.scalar(pts[f"dp2-{d}"], "bench.json", "tokens_per_s") for d in DEALINGS}
        saved = runs.derived(idle["rows"].value - idle["depth"].value, list(idle.values()),
                             "idle fraction under rows minus under depth dealing")
        out.table(["dealing (2 ranks)", "mean idle fraction", "tokens/s"],
                  [[d, idle[d], tps[d]] for d in DEALINGS])
        verb = "cut the ranks' idle fraction by" if saved.value > 0 else "did not cut the ranks' idle fraction " \
            "(rows minus depth:"
        end = "" if saved.value > 0 else ")"
        out.text(f"**Depth-balanced dealing** {verb} {out.num(saved, '.3f')}{end} (absolute) against equal rows. With two ranks on a 2-core machine shared with other work, the "
                 "tokens/s of the two runs are noisier than the idle fractions, which are counts of work.")

    def _plot(self, pts: dict, variants, runs, out) -> None:
        from megaloop.repro.studies.plotting import new_figure, save

        fig, (ax,) = new_figure()
        names, useful, executed, used = [], [], [], []
        for v in variants:
            p = pts[f"bench-{v}"]
            u = runs.scalar(p, "bench.json", "useful_tflops")
            e = runs.scalar(p, "bench.json", "executed_tflops")
            names.append(LABELS[v])
            useful.append(u.value)
            executed.append(e.value)
            used += [u, e]
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], executed, width=0.4, label="executed")
        ax.bar([i + 0.2 for i in x], useful, width=0.4, label="useful")
        ax.set_xticks(list(x), names)
        ax.set_ylabel("TFLOP/s")
        ax.legend()
        save(fig, out.figure("flops", "useful and executed TFLOP/s per model (megaloop bench)", used))


STUDY = Throughput()
