"""Test-time law points per difficulty, from the table `megaloop eval --tasks synth` makes (megaloop.eval.synth):
for each hops count, the points (T, value) that megaloop.laws.testtime.compare_forms fits against T.

Metrics: "loss", the mean answer loss in nats; "error", the answer error rate as the add-half estimate
(n - correct + 0.5) / (n + 1), which stays > 0 when every answer is right (the laws fit log values, and an error
of 0 has none) and is within 0.5 / (n + 1) of 1 - accuracy. Both fall as T grows where looping pays, as the
test-time forms do.
"""
from __future__ import annotations

import numpy as np

METRICS = ("loss", "error")


def metric_value(entry: dict, metric: str) -> float:
    """One (T, hops) cell's value under `metric` (see the module docstring)."""
    if metric == "loss":
        return float(entry["loss"])
    if metric == "error":
        n = int(entry["n"])
        correct = round(float(entry["acc"]) * n)
        return (n - correct + 0.5) / (n + 1)
    raise ValueError(f"unknown metric {metric!r}; use one of {', '.join(METRICS)}")


def points_by_difficulty(result: dict, metric: str = "loss") -> dict[int, list[tuple[int, float]]]:
    """{hops: [(T, value), ...] in increasing T} from a synth table (`result` as evaluate_synth returns it, or as
    read back from --json, whose keys are strings)."""
    points: dict[int, list[tuple[int, float]]] = {}
    for t, table in result["by_depth"].items():
        for hops, entry in table.items():
            points.setdefault(int(hops), []).append((int(t), metric_value(entry, metric)))
    return {k: sorted(v) for k, v in sorted(points.items())}


def columns(points: list[tuple[int, float]]) -> dict[str, np.ndarray]:
    """One difficulty's points as the columns the test-time forms read: {"T": ..., "loss": ...} (the value, whatever
    the metric, goes in the "loss" column)."""
    return {"T": np.array([t for t, _ in points], dtype=float), "loss": np.array([v for _, v in points], dtype=float)}


def fit_by_difficulty(result: dict, metric: str = "loss", **fit_options) -> dict[int, dict]:
    """{hops: megaloop.laws.testtime.compare_forms of that difficulty's points} (fit_options go to it: split, boot,
    seed, ...). A difficulty with fewer than 4 depths raises FitError, as compare_forms does."""
    from megaloop.laws.testtime import compare_forms

    return {k: compare_forms(columns(p), **fit_options) for k, p in points_by_difficulty(result, metric).items()}
