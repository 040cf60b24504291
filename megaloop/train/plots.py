"""`python -m megaloop plot RUN_DIR`: PNGs of a run from its metrics.jsonl: the training loss (loss spikes
marked), rho(A) and ||h_T|| per step, and the test-time curve (validation loss at each depth T of the final
validation)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from data_prep.paths import LocalPath

HELP = "draw a run's training loss, rho(A), ||h_T|| and test-time curve as PNGs (into RUN_DIR/plots)"
SERIES = (("loss", "training loss", "loss.png"), ("rho_A", "rho(A) (spectral radius of the injection)", "rho_A.png"),
          ("state_norm", "||h_T|| (the loop's final state, RMS per position)", "state_norm.png"))


class RunPlotError(ValueError):
    """The run directory cannot be plotted (no metrics, or no training record)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", type=LocalPath(as_path=True),
                   metavar="RUN_DIR", help="a run directory (with metrics.jsonl)")
    p.add_argument("--out", type=LocalPath(as_path=True), default=None,
                   help="folder for the PNGs (default RUN_DIR/plots)")


def run_plot(args) -> int:
    try:
        paths = plot_run(args.run_dir, args.out)
    except RunPlotError as err:
        print(f"megaloop plot: {err}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


def _records(run_dir: Path) -> list[dict]:
    from megaloop.train.metrics import read_metrics

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise RunPlotError(f"{run_dir}: no metrics.jsonl (not a run directory, or the run wrote no metrics)")
    try:
        records = read_metrics(path)
    except ValueError as err:
        raise RunPlotError(f"{path}: not JSON lines ({err})") from None
    return _current(records)


def _current(records: list[dict]) -> list[dict]:
    """The records in force: a "resume" record at step s supersedes the earlier records of steps >= s."""
    out: list[dict] = []
    for r in records:
        if r.get("kind") == "resume":
            out = [x for x in out if x.get("step", -1) < r["step"]]
        out.append(r)
    return out


def plot_run(run_dir: Path, out: Path | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = _records(run_dir)
    train = [r for r in records if r.get("kind") == "train"]
    if not train:
        raise RunPlotError(f"{run_dir}: metrics.jsonl has no training record")
    out = Path(out) if out is not None else Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    spikes = [r for r in records if r.get("kind") == "spike"]
    paths = []
    for key, label, name in SERIES:
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
        ax.plot([r["step"] for r in train], [r.get(key, float("nan")) for r in train], lw=1)
        if key == "loss" and spikes:
            ax.scatter([s["step"] for s in spikes], [s["loss"] for s in spikes], color="red", zorder=3,
                       label=f"loss spikes ({len(spikes)})")
            ax.legend(fontsize=7)
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        paths.append(_save(fig, plt, out / name))
    val = [r for r in records if r.get("kind") == "val"]
    if val:
        last = max(r["step"] for r in val)
        curve = sorted((r["T"], r["val_loss"]) for r in val if r["step"] == last)
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
        ax.plot([t for t, _ in curve], [v for _, v in curve], "o-")
        ax.set_xlabel("test-time depth T")
        ax.set_ylabel(f"validation loss (step {last})")
        paths.append(_save(fig, plt, out / "testtime.png"))
    return paths


def _save(fig, plt, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
