"""(i) isoFLOP on k-hop: Parcae (configs/parcae-synth.yaml) at mu_rec in {1, 2, 4, 8}, each trained on as many steps
as its FLOP budget buys at its mu_rec (as (d)), judged by the held-out answer loss on the hardest trained difficulty
at T = mu_rec. Here a shallow loop cannot follow enough pointers and a deep one trains on few steps, so the optimum
can lie inside the grid, where (d)'s text-corpus optimum sat at its smallest mu_rec.
"""
from __future__ import annotations

from megaloop.repro.sizes import SYNTH_SIZES
from megaloop.repro.studies import synth_common as sc
from megaloop.repro.studies.isoflop import IsoFlopStudy, Metric, Size


def _hardest(runs, p):
    return sc.cell(runs, p, p.labels["mu_rec"], p.labels["hops"], "loss")


def _evaluation(scale, mu_rec: int) -> dict:
    return {"eval_depths": (mu_rec,), "eval_rows": sc.eval_rows(scale), "eval_tasks": "synth",
            "labels": {"hops": sc.hops(scale)[-1]}}


ANSWER_LOSS = Metric(_hardest, "answer loss, hardest hops, T = mu_rec",
                     "each run's held-out answer loss on the hardest trained difficulty at T = mu_rec "
                     "(`megaloop eval --tasks synth`)", _evaluation)
SIZES = {
    "smoke": Size(SYNTH_SIZES["smoke"]["model"], (1, 2, 4), (), 50, (20, 40)),
    # budgets: the FLOPs of 600 and 1200 steps at mu_rec 1; mu_rec 8 then gets about a fifth of those steps
    "full": Size((), (1, 2, 4, 8), (), 500, (600, 1200)),
}

STUDY = IsoFlopStudy(name="synth_isoflop", title="isoFLOP on k-hop", config=sc.PARCAE, sizes=SIZES,
                     metric=ANSWER_LOSS)
