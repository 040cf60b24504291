"""The test-time study: its points, and its analysis on eval.json files drawn from known test-time laws."""
from pathlib import Path

import numpy as np
import pytest

from megaloop.laws.forms import TESTTIME_FORMS
from megaloop.repro.study import Scale
from megaloop.repro.studies import testtime
from tests.repro.laws_fakes import FakeArtifacts, FakeWriter, write_json

STUDY = testtime.STUDY


@pytest.fixture(autouse=True)
def fewer_starts(monkeypatch):
    """Fewer random starts than the report's fits (16 of 200): the suite's time; the laws here are smooth."""
    monkeypatch.setattr(testtime, "FIT", {"restarts": 4, "screen": 50, "seed": 0})


def scale(name: str, work: Path) -> Scale:
    return Scale(name, Path("corpus"), work)


def test_points_are_deterministic_and_span_four_mu_rec(tmp_path):
    for name in ("smoke", "full"):
        points = STUDY.points(scale(name, tmp_path))
        assert points == STUDY.points(scale(name, tmp_path))
        assert len({p.name for p in points}) == len(points)
        for p in points:
            mu = p.labels["mu_rec"]
            assert f"model.mu_rec={mu}" in p.overrides and p.study == "testtime"
            assert min(p.eval_depths) == 1 and max(p.eval_depths) >= 4 * mu
    full = STUDY.points(scale("full", tmp_path))
    assert len({p.labels["seed"] for p in full}) == len(full)


def fake_runs(work: Path, points, form: str, truth: dict, noise: float = 0.0, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for p in points:
        t = np.array(p.eval_depths, dtype=float)
        loss = TESTTIME_FORMS[form].predict(truth, {"T": t}) * (1 + noise * rng.standard_normal(len(t)))
        depths = {str(int(d)): {"loss": float(v), "ci_low": float(v) - 0.01, "ci_high": float(v) + 0.01}
                  for d, v in zip(t, loss)}
        write_json(work / "runs" / p.study / p.name / "eval.json", {"mu_rec": p.labels["mu_rec"], "depths": depths})


@pytest.mark.parametrize("form,truth", [("exp", {"L_inf": 3.0, "Z": 2.0, "z": 0.5}),
                                        ("pure_power", {"Z": 5.0, "z": 0.3})])
def test_analysis_recovers_the_law_and_chooses_its_form(tmp_path, monkeypatch, form, truth):
    seeds = (0, 1) if form == "exp" else (0,)  # two models once: the statement across models
    monkeypatch.setitem(testtime.SIZES, "full", testtime.SIZES["full"].__class__(
        **{**testtime.SIZES["full"].__dict__, "boot": 4, "seeds": seeds}))
    points = STUDY.points(scale("full", tmp_path))
    fake_runs(tmp_path, points, form, truth)
    out = FakeWriter(tmp_path / "figures")
    STUDY.analyse(scale("full", tmp_path), FakeArtifacts(tmp_path), out)
    text = out.markdown
    assert text.count(f"the form chosen is **{form}**") == len(points)
    assert (f"the same form, **{form}**, is chosen on all 2 models" if len(points) == 2 else
            f"**{form}** is chosen on 1 of 1 model(s) (one model: no statement of robustness)") in text
    assert ("This agrees with the paper" in text) == (form == "exp")
    assert ("This disagrees with the paper" in text) == (form != "exp")
    # each fitted parameter of the true form, as rendered, within 3% of the truth
    for name, true in truth.items():
        fitted = [v.value for v in out.values if v.how == f"{name} of the {form} fit on every T"]
        assert len(fitted) == len(points)
        assert np.allclose(fitted, true, rtol=0.03), (name, fitted, true)
    # every rendered number traces to eval.json of the study's runs
    assert all(s.file == "eval.json" and s.run.startswith("runs/testtime/") for v in out.values for s in v.sources)
    assert len(out.figures) == 1 and out.figures[0].read_bytes()[:4] == b"\x89PNG"


def test_analysis_reports_too_few_depths_without_failing(tmp_path):
    p = STUDY.points(scale("smoke", tmp_path))[0]
    p = p.__class__(**{**p.__dict__, "eval_depths": (1, 2, 3)})
    fake_runs(tmp_path, [p], "exp", {"L_inf": 3.0, "Z": 2.0, "z": 0.5})
    out = FakeWriter(tmp_path / "figures")
    testtime.write_section([p], 5, FakeArtifacts(tmp_path), out)
    assert "not enough points for the test-time fit" in out.markdown
    assert not out.figures


def test_a_changed_eval_file_changes_the_section(tmp_path):
    points = STUDY.points(scale("smoke", tmp_path))
    truth = {"L_inf": 3.0, "Z": 2.0, "z": 0.5}
    fake_runs(tmp_path, points, "exp", truth)
    first = FakeWriter(tmp_path / "a")
    testtime.write_section(points, 0, FakeArtifacts(tmp_path), first)
    fake_runs(tmp_path, points, "exp", {**truth, "L_inf": 4.0})
    second = FakeWriter(tmp_path / "b")
    testtime.write_section(points, 0, FakeArtifacts(tmp_path), second)
    assert first.markdown != second.markdown
    # the loss table's row T = 1, L_inf + 2 e^-0.5, as read from the file each time
    assert first.tables[0][1][0][1].startswith("4.213") and second.tables[0][1][0][1].startswith("5.213")
