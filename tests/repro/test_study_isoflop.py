"""The isoFLOP study: each point's training FLOPs equal its budget (by an independent count of the model's matmuls),
and the analysis of summaries drawn from a known compute-optimal law recovers that law."""
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from megaloop.config import load_config
from megaloop.model import build_model
from megaloop.repro.study import Scale
from megaloop.repro.studies import isoflop
from tests.repro.laws_fakes import FakeArtifacts, FakeWriter, write_json

STUDY = isoflop.STUDY
REPO = Path(__file__).resolve().parents[2]


def scale(name: str, work: Path = Path("work")) -> Scale:
    return Scale(name, Path("corpus"), work)


def flops_per_token(point) -> tuple[float, int]:
    """Training FLOPs per token at T = mu_rec counted on the built model (2 per weight per token forward, 4 backward;
    attention 4 d S per layer forward; laps without gradient forward only), and the tokens per step."""
    cfg = load_config(REPO / point.config, list(point.overrides), validate=False)
    m = cfg.model
    model = build_model(m, device="meta")
    weights = {part: sum(p.numel() for n, p in model.named_parameters() if n.startswith(part) and p.dim() == 2)
               for part in ("prelude.", "core.", "coda.", "C.", "injection.")}
    d, s = m.d_model, m.seq_len
    k = math.ceil(m.mu_rec / 2)  # the paper's truncated backprop: mu_bwd = ceil(mu_rec / 2)
    once = 6 * (weights["prelude."] + weights["coda."] + weights["C."] + weights["injection."] + m.vocab_size * d)
    once += 12 * d * s * (m.n_prelude + m.n_coda)
    lap = weights["core."]
    per_token = once + (m.mu_rec - k) * (2 * lap + 4 * d * s * m.n_core) + k * (6 * lap + 12 * d * s * m.n_core)
    return per_token, cfg.data.global_batch_size * s


@pytest.mark.parametrize("name,shape", [("smoke", {}), ("full", {}),
                                        ("smoke", {"seq_len": 32, "vocab_size": 512, "budget": 1.0})])
def test_points_spend_their_budget(name, shape):
    sc = SimpleNamespace(**{**scale(name).__dict__, **shape})  # a scale whose shards fix the rows and vocabulary
    points = STUDY.points(sc)
    assert points == STUDY.points(sc)
    if shape:
        assert all("model.seq_len=32" in p.overrides and "model.vocab_size=512" in p.overrides for p in points)
    if name == "smoke":  # toy sizes whatever the shards: tens of steps
        assert max(p.labels["steps"] for p in points) <= 45 and min(p.labels["steps"] for p in points) >= 10
    size = isoflop.SIZES[name]
    assert sorted({p.labels["mu_rec"] for p in points}) == list(size.mu_values)
    assert len(points) == len(size.mu_values) * len(size.budgets + size.base_steps) == len({p.name for p in points})
    for p in points:
        per_token, tokens_per_step = flops_per_token(p)
        steps = int(next(o for o in p.overrides if o.startswith("train.steps=")).split("=")[1])
        trained = steps * tokens_per_step * per_token
        # whole steps: within half a step's FLOPs of the budget; at full scale 2% or better
        half_step = 0.5 * tokens_per_step * per_token / p.labels["budget"]
        assert abs(trained / p.labels["budget"] - 1) <= half_step + 1e-9, (p.name, trained, p.labels["budget"])
        assert name != "full" or abs(trained / p.labels["budget"] - 1) <= 0.02
        assert p.labels["flops_per_token"] == pytest.approx(per_token, rel=1e-12)
    if name == "full":
        assert set(size.mu_values) == {1, 2, 4, 8} and len(size.budgets) == 3


GAMMA, CURVATURE = 0.4, 0.08


def mu_opt(c: float) -> float:
    return 2.0 * (c / 1.2e12) ** GAMMA


def fake_runs(work: Path, points, mu_star=mu_opt) -> None:
    """summary.json and config.json of each point: its tokens as trained, a loss that is a parabola in log mu_rec
    around mu_star(C) at its budget C, plus a term falling with C: exactly a parabola
    within a budget."""
    nominal = {p.name: p.labels["steps"] * p.labels["tokens_per_step"] * p.labels["flops_per_token"] for p in points}
    budget = {b: np.mean([nominal[p.name] for p in points if p.labels["budget"] == b])
              for b in {p.labels["budget"] for p in points}}  # C of a budget: its points' mean trained FLOPs
    for p in points:
        mu, c = p.labels["mu_rec"], nominal[p.name]
        tokens = p.labels["steps"] * p.labels["tokens_per_step"]
        cb = budget[p.labels["budget"]]
        loss = 3.0 + CURVATURE * math.log(mu / mu_star(cb)) ** 2 + 50 * cb ** -0.1
        run = work / "runs" / p.study / p.name
        write_json(run / "summary.json", {"tokens": tokens, "useful_flops": 0.97 * c,
                                          "val": {str(mu): {"val_loss": loss}}})
        write_json(run / "config.json", {"model": {"mu_rec": mu}})


def test_analysis_recovers_the_exponent_of_mu_star(tmp_path, monkeypatch):
    monkeypatch.setitem(isoflop.SIZES, "full", isoflop.SIZES["full"].__class__(
        **{**isoflop.SIZES["full"].__dict__, "boot": 20}))
    points = STUDY.points(scale("full", tmp_path))
    fake_runs(tmp_path, points)
    out = FakeWriter(tmp_path / "figures")
    STUDY.analyse(scale("full", tmp_path), FakeArtifacts(tmp_path), out)
    rendered = {v.how: v.value for v in out.values}
    gamma = rendered["exponent of mu* = k C^gamma_mu (least squares in log-log over the budgets' vertices)"]
    assert gamma == pytest.approx(GAMMA, rel=1e-3)
    vertices = [v.value for v in out.values if v.how.startswith("vertex of the parabola of loss in log mu_rec")]
    assert np.allclose(vertices, [mu_opt(b) for b in isoflop.SIZES["full"].budgets], rtol=0.05)
    low = rendered["exponent of mu* = k C^gamma_mu (least squares in log-log over the budgets' vertices) (ci_low, bootstrap)"]
    high = rendered["exponent of mu* = k C^gamma_mu (least squares in log-log over the budgets' vertices) (ci_high, bootstrap)"]
    assert low <= gamma <= high and high - low < 0.01  # exact parabolas: the usable resamples agree
    assert "contains the paper's 0.4" in out.markdown and "Disagreement with the paper" not in out.markdown
    assert all(s.run.startswith("runs/isoflop/") and s.file in ("summary.json", "config.json")
               for v in out.values for s in v.sources)
    assert out.figures and out.figures[0].read_bytes()[:4] == b"\x89PNG"


def test_a_falling_optimum_is_reported_as_a_disagreement(tmp_path):
    points = STUDY.points(scale("full", tmp_path))
    fake_runs(tmp_path, points, mu_star=lambda c: 6.0 * (c / 1.2e12) ** -0.5)
    out = FakeWriter(tmp_path / "figures")
    isoflop.write_section(points, 10, FakeArtifacts(tmp_path), out)
    assert "disagrees with the paper's 0.4" in out.markdown


def test_an_optimum_below_the_grid_is_reported_as_a_disagreement(tmp_path):
    points = STUDY.points(scale("full", tmp_path))
    fake_runs(tmp_path, points, mu_star=lambda c: 0.6 * (c / 1.2e12) ** 0.2)
    out = FakeWriter(tmp_path / "figures")
    isoflop.write_section(points, 0, FakeArtifacts(tmp_path), out)
    assert "**Disagreement with the paper**: at every budget the lowest loss is at the smallest mu_rec" in out.markdown
    assert "consistent" not in out.markdown


def test_one_budget_is_not_enough_points(tmp_path):
    points = STUDY.points(scale("smoke", tmp_path))
    points = [p for p in points if p.labels["budget"] == points[0].labels["budget"]]
    fake_runs(tmp_path, points)
    out = FakeWriter(tmp_path / "figures")
    isoflop.write_section(points, 10, FakeArtifacts(tmp_path), out)
    assert "Not enough points for the isoFLOP fit" in out.markdown and not out.figures
    assert len(out.tables) == 1 and len(out.tables[0][1]) == len(points)  # the measured points are still listed
