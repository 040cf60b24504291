"""megaloop.laws.difficulty: a synth eval table becomes (T, value) points per difficulty, the error metric is the
add-half estimate computed by hand, JSON's string keys are read, and the test-time fit recovers the law that made
each difficulty's points."""
from __future__ import annotations

import json

import numpy as np
import pytest

from megaloop.laws.difficulty import columns, fit_by_difficulty, metric_value, points_by_difficulty
from megaloop.laws.fit import FitError

LAWS = {1: (0.1, 2.0, 0.8), 2: (0.3, 2.5, 0.4)}  # hops: (L_inf, Z, z) of L_inf + Z exp(-z T)


def _cell(acc: float, loss: float, n: int) -> dict:
    return {"acc": acc, "acc_lo": acc, "acc_hi": acc, "loss": loss, "loss_lo": loss, "loss_hi": loss, "n": n}


def _table(depths=(1, 2, 3, 4, 6, 8)) -> dict:
    """A synth result whose losses follow LAWS exactly and whose accuracy is 1 - 0.1 hops / T."""
    return {"task": "khop", "rows": 10, "queries": 200, "by_depth": {
        t: {k: _cell(1 - 0.1 * k / t, law[0] + law[1] * np.exp(-law[2] * t), 100) for k, law in LAWS.items()}
        for t in depths}}


def test_points_per_difficulty_in_increasing_t():
    table = _table(depths=(4, 1, 2))
    points = points_by_difficulty(table, "loss")
    assert sorted(points) == [1, 2]
    assert [t for t, _ in points[2]] == [1, 2, 4]
    assert points[2][0][1] == pytest.approx(0.3 + 2.5 * np.exp(-0.4))
    cols = columns(points[1])
    assert cols["T"].tolist() == [1.0, 2.0, 4.0] and cols["loss"][2] == pytest.approx(0.1 + 2.0 * np.exp(-3.2))


def test_error_is_the_add_half_estimate():
    assert metric_value(_cell(0.9, 1.0, 100), "error") == pytest.approx(10.5 / 101)
    assert metric_value(_cell(1.0, 1.0, 40), "error") == pytest.approx(0.5 / 41)  # > 0 when every answer is right
    points = points_by_difficulty(_table(), "error")
    assert points[2][0] == (1, pytest.approx((100 - 80 + 0.5) / 101))
    with pytest.raises(ValueError, match="unknown metric 'acc'"):
        metric_value(_cell(0.5, 1.0, 10), "acc")


def test_json_round_trip_gives_the_same_points():
    table = _table()
    assert points_by_difficulty(json.loads(json.dumps(table)), "error") == points_by_difficulty(table, "error")


def test_fit_recovers_each_difficultys_law():
    fits = fit_by_difficulty(_table(), "loss", boot=0, restarts=4, screen=50, split=4)
    for k, (l_inf, z_scale, z) in LAWS.items():
        exp = fits[k]["forms"]["exp"]
        assert exp["L_inf"]["value"] == pytest.approx(l_inf, rel=1e-3)
        assert exp["Z"]["value"] == pytest.approx(z_scale, rel=1e-3)
        assert exp["z"]["value"] == pytest.approx(z, rel=1e-3)
        assert fits[k]["selected"] == "exp" and exp["rmse_out"] < 1e-4


def test_too_few_depths_cannot_be_fitted():
    with pytest.raises(FitError, match="too few points"):
        fit_by_difficulty(_table(depths=(1, 2, 4)), "loss", boot=0)
