"""What the synth testbed's studies share: the configs, the point sizes per scale, and reading `megaloop eval --tasks
synth` tables (eval.json's "synth") back as Values.

A synth point trains on the scale's k-hop dataset (megaloop.repro.shards.prepare_synth) and is evaluated on its
held-out rows (tables unseen in training) at the depths it names: exact-match accuracy and loss on the answer tokens
per difficulty (hops), with 95% bootstrap intervals over answers (megaloop.eval.synth)."""
from __future__ import annotations

import math

from megaloop.repro.sizes import SYNTH_SIZES
from megaloop.repro.study import Artifacts, Point, Scale, Value

PARCAE = "configs/parcae-synth.yaml"
GPT = "configs/gpt-synth.yaml"
FULL_STEPS = 800     # the configs' train.steps: what learns 2-hop answers at parcae-synth's size
EVAL_DEPTHS = {"smoke": (1, 2, 4, 8, 16), "full": (1, 2, 3, 4, 6, 8, 12, 16)}  # 1 .. 2 mu_rec


def steps(scale: Scale, full: int = FULL_STEPS, smoke: int = 8) -> int:
    return scale.steps(full=full, smoke=smoke)


def sized(scale: Scale, *overrides: str) -> tuple[str, ...]:
    """The scale's model resizing (smoke only), then the point's own overrides."""
    return (*SYNTH_SIZES[scale.name]["model"], *overrides)


def trained(scale: Scale, n: int, mu_rec: int) -> tuple[str, ...]:
    """n steps, one validation at the end at T = mu_rec on 2 batches, and a few checkpoints (resume points)."""
    return (f"train.steps={n}", f"train.val_every={n}", f"train.val_depths=[{mu_rec}]", "data.val_batches=2",
            f"checkpoint.every={max(1, n // 4)}")


def eval_rows(scale: Scale) -> int:
    return SYNTH_SIZES[scale.name]["val_rows"]


def hops(scale: Scale) -> list[int]:
    lo, hi = SYNTH_SIZES[scale.name]["hops"]
    return list(range(lo, hi + 1))


def cell(runs: Artifacts, p: Point, t: int, k: int, field: str) -> Value:
    """One number of the point's synth table: field acc, acc_lo, acc_hi, loss, loss_lo, loss_hi or n at depth T and
    difficulty k."""
    return runs.scalar(p, "eval.json", f"synth.by_depth.{t}.{k}.{field}")


def answer_loss(runs: Artifacts, p: Point, t: int, ks: list[int]) -> Value:
    """The mean answer loss over every difficulty at depth T (weighted by answers)."""
    parts = [(cell(runs, p, t, k, "loss"), cell(runs, p, t, k, "n")) for k in ks]
    total = sum(n.value for _, n in parts)
    mean = sum(v.value * n.value for v, n in parts) / total if total else math.nan
    return runs.derived(mean, [v for pair in parts for v in pair], f"mean answer loss over hops {ks} at T = {t} "
                        "(weighted by answers)")


def table(runs: Artifacts, p: Point, ks: list[int]) -> dict:
    """The point's synth table in the shape megaloop.laws.difficulty reads: {"by_depth": {T: {k: {"acc", "loss",
    "n"}}}} of plain numbers, and the Values they came from (for derived numbers' sources)."""
    by_depth, values = {}, []
    for t in p.eval_depths:
        by_depth[t] = {}
        for k in ks:
            entry = {f: cell(runs, p, t, k, f) for f in ("acc", "loss", "n")}
            values += entry.values()
            by_depth[t][k] = {f: v.value for f, v in entry.items()}
    return {"by_depth": by_depth, "values": values}


def acc_text(out, runs: Artifacts, p: Point, t: int, k: int) -> str:
    """"acc [lo, hi]" of one cell, each number sourced."""
    return (f"{out.num(cell(runs, p, t, k, 'acc'), '.3f')} [{out.num(cell(runs, p, t, k, 'acc_lo'), '.3f')}, "
            f"{out.num(cell(runs, p, t, k, 'acc_hi'), '.3f')}]")
