"""The points a law is fitted to: a CSV (columns params, mu_rec, tokens, flops, T, loss, n_once, n_rec, r; unused
ones may be absent) or run directories.

A run directory gives one point per validation depth T of its final validation (metrics.jsonl's "val" records at
the run's last step, else summary.json's "val"): params = the model's parameters (summary n_params), mu_rec and
r = the config's model.mu_rec, tokens = the run's trained tokens, flops = its useful training FLOPs, n_rec = the
looped core blocks' parameters (counted from the config), n_once = params - n_rec. The laws of training (parametric,
isoflop, phi) take each run's point at T = mu_rec, the depth it trained at.
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np

COLUMNS = ("params", "mu_rec", "tokens", "flops", "T", "loss", "n_once", "n_rec", "r")


class LawInputError(ValueError):
    """Unreadable or incomplete input for a law fit (one line, names the file and what is missing)."""


def read_csv(path: Path) -> dict[str, np.ndarray]:
    path = Path(path)
    try:
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            header = [h.strip() for h in reader.fieldnames or []]
            rows = list(reader)
    except OSError as err:
        raise LawInputError(f"{path}: cannot read ({err.strerror})") from None
    unknown = [h for h in header if h not in COLUMNS]
    if unknown:
        raise LawInputError(f"{path}: unknown column(s) {unknown}; the columns are {', '.join(COLUMNS)}")
    cols = {h: [] for h in header}
    for i, row in enumerate(rows, start=2):
        for raw_key, value in row.items():
            try:
                cols[raw_key.strip()].append(float(value))
            except (TypeError, ValueError):
                raise LawInputError(f"{path}:{i}: column {raw_key.strip()!r} value {value!r} is not a number") from None
    return {k: np.array(v) for k, v in cols.items()}


def read_run_dirs(paths: list[Path]) -> dict[str, np.ndarray]:
    rows = [row for p in paths for row in run_points(Path(p))]
    return {k: np.array([r[k] for r in rows], dtype=float) for k in COLUMNS}


def _load(path: Path, name: str) -> dict:
    try:
        return json.loads((path / name).read_text())
    except OSError:
        raise LawInputError(f"{path}: not a finished run directory: {name} is missing") from None
    except ValueError as err:
        raise LawInputError(f"{path / name}: not valid JSON ({err})") from None


def _field(data: dict, keys: str, where: Path):
    value = data
    for key in keys.split("."):
        if not isinstance(value, dict) or key not in value:
            raise LawInputError(f"{where}: field {keys!r} is missing")
        value = value[key]
    return value


def final_validation(path: Path, summary: dict) -> dict[int, float]:
    """{T: val_loss} of the run's final validation (metrics.jsonl at its last validated step, else summary)."""
    from megaloop.train.metrics import read_metrics

    metrics = path / "metrics.jsonl"
    vals = [r for r in read_metrics(metrics) if r.get("kind") == "val"] if metrics.exists() else []
    if vals:
        last = max(r["step"] for r in vals)
        return {int(r["T"]): float(r["val_loss"]) for r in vals if r["step"] == last}
    val = _field(summary, "val", path / "summary.json")
    return {int(t): float(_field(v, "val_loss", path / "summary.json")) for t, v in val.items()}


def run_points(path: Path) -> list[dict]:
    config, summary = _load(path, "config.json"), _load(path, "summary.json")
    mu_rec = int(_field(config, "model.mu_rec", path / "config.json"))
    params = float(_field(summary, "n_params", path / "summary.json"))
    base = {"params": params, "mu_rec": mu_rec, "r": mu_rec,
            "tokens": float(_field(summary, "tokens", path / "summary.json")),
            "flops": float(_field(summary, "useful_flops", path / "summary.json"))}
    n_rec = looped_parameters(config, path)
    base.update(n_rec=n_rec, n_once=params - n_rec)
    val = {t: v for t, v in final_validation(path, summary).items() if math.isfinite(v)}
    if not val:
        raise LawInputError(f"{path}: the run has no finite validation loss (a run with data.val_batches=0, or "
                            "interrupted before its final validation)")
    return [{**base, "T": t, "loss": v} for t, v in sorted(val.items())]


def looped_parameters(config: dict, where: Path) -> float:
    """Parameters of the core blocks the loop runs (the reference's N_core), counted on the meta device."""
    from megaloop.config import Config, ConfigError
    from megaloop.config.load import from_dict
    from megaloop.model import build_model

    raw = _field(config, "model", where / "config.json")
    try:
        model_cfg = from_dict(type(Config().model), raw, "model.")
        model = build_model(model_cfg, device="meta")
    except (ConfigError, ValueError, TypeError) as err:
        raise LawInputError(f"{where / 'config.json'}: {err}") from None
    return float(sum(p.numel() for n, p in model.named_parameters() if n.startswith("core.")))
