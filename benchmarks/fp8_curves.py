"""FP8 against bf16 in training: parcae-tiny for 300 steps with train.fp8 none (bf16), tensorwise and rowwise, on
the same data and seed. Prints the loss curves (mean over each window of steps), the final training loss (mean of
the last 20 steps: one step's loss is one batch's) and the validation loss at each depth, with each FP8 run's
relative difference from bf16, and writes a PNG of the curves.

    python benchmarks/fp8_curves.py [--steps 300] [--corpus DIR] [--png FILE] [--set key=value ...]
    python benchmarks/fp8_curves.py --run tensorwise --save DIR   # one run only, its results saved in DIR
    python benchmarks/fp8_curves.py --report DIR                  # the comparison of the runs saved in DIR
    python benchmarks/fp8_curves.py --config configs/parcae-140m.yaml --steps 50 --seq-len 512 --tail 10 \
        --runs none tensorwise rowwise te --set train.device=cuda   # on a GPU (scripts/gpu_check.sh)

Runs: none (bf16), tensorwise and rowwise (torchao's recipes, pipeline/fp8.py), te (Transformer Engine's
Float8CurrentScaling: train.fp8=tensorwise, train.fp8_backend=te; GPU only). (--run/--save let the runs go in
parallel processes; each builds the same shards from the same corpus.)

The shards are built here (vocab 4096, --seq-len-token rows, default 128) from --corpus, else the shared corpus's
chapters, else the bundled sample corpus. On a CPU the FP8 GEMMs run through torch._scaled_mm's CPU kernel: the
figures are about numerics, not speed."""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.corpus_shards import build_shards, corpus_files  # noqa: E402

RUNS = ("none", "tensorwise", "rowwise")  # the default runs (CPU)
CHOICES = RUNS + ("te",)
TAIL = 20  # steps averaged for the final training loss
TOL = 0.015  # the acceptance bound: final train and val losses within 1.5% of bf16's
TINY = REPO / "configs" / "parcae-tiny.yaml"


def run_overrides(run: str) -> list[str]:
    """The FP8 settings of a run name (see the module docstring)."""
    if run not in CHOICES:
        raise ValueError(f"run {run!r}: use one of {', '.join(CHOICES)}")
    return ["train.fp8=tensorwise", "train.fp8_backend=te"] if run == "te" else [f"train.fp8={run}"]


def label(run: str) -> str:
    return "bf16" if run == "none" else f"fp8 {run}"


def train_run(shards: Path, out: Path, run: str, steps: int, extra: list[str], config: Path = TINY,
              seq_len: int = 128):
    from megaloop.config import load_config
    from megaloop.train.loop import train

    cfg = load_config(str(config),
                      [f"data.shards={shards}", f"train.out_dir={out}", f"train.steps={steps}", "train.precision=bf16",
                       f"model.seq_len={seq_len}", *run_overrides(run), f"train.val_every={steps}",
                       "checkpoint.async_save=false", *extra])
    return train(cfg)


def windows(losses: list[float], width: int) -> list[tuple[int, float]]:
    return [(i + width, sum(losses[i:i + width]) / len(losses[i:i + width])) for i in range(0, len(losses), width)]


def report(summaries: dict, width: int, tail: int = TAIL, tol: float = TOL) -> bool:
    """Print the curves side by side (bf16 first) and each run's final losses against bf16's; True when every final
    training loss (mean of the last `tail` steps) and validation loss is within `tol` (relative) of bf16's."""
    if "none" not in summaries:
        raise ValueError("the comparison needs the bf16 run (none)")
    curves = {name: windows(s.losses, width) for name, s in summaries.items()}
    print("step   " + "  ".join(f"{label(n):>16s}" for n in summaries))
    for i, (step, _) in enumerate(curves["none"]):
        print(f"{step:5d}  " + "  ".join(f"{curves[n][i][1]:16.4f}" for n in summaries))
    base = summaries["none"]
    base_train = sum(base.losses[-tail:]) / len(base.losses[-tail:])
    ok = True
    for name, s in summaries.items():
        train_loss = sum(s.losses[-tail:]) / len(s.losses[-tail:])
        rel = (train_loss - base_train) / base_train
        vals = {t: v["val_loss"] for t, v in sorted(s.val.items())}
        val_rel = {t: (v - base.val[t]["val_loss"]) / base.val[t]["val_loss"] for t, v in vals.items()}
        print(f"{label(name):16s} final train loss (mean of last {tail}) {train_loss:.4f} ({rel:+.2%} vs bf16); val "
              + ", ".join(f"T={t}: {v:.4f} ({val_rel[t]:+.2%})" for t, v in vals.items()))
        ok &= abs(rel) <= tol and all(abs(r) <= tol for r in val_rel.values()) and len(vals) == len(base.val)
    print(f"every final loss within {tol:.1%} of bf16's: {ok}")
    return ok


def plot(summaries: dict, width: int, png: Path, title: str = "parcae-tiny: FP8 vs bf16 (CPU)") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, s in summaries.items():
        xs, ys = zip(*windows(s.losses, width))
        ax.plot(xs, ys, label="bf16" if name == "none" else f"FP8 {name} (core)")
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (mean over {width} steps)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


def save(summary, path: Path) -> None:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"losses": summary.losses, "val": summary.val}))


def load_saved(root: Path) -> dict:
    import json
    from types import SimpleNamespace

    out = {}
    for fp8 in [r for r in CHOICES if (root / f"{r}.json").is_file()]:
        data = json.loads((root / f"{fp8}.json").read_text())
        out[fp8] = SimpleNamespace(losses=data["losses"], val={int(t): v for t, v in data["val"].items()})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--config", default=str(TINY), help="model/training config (default: parcae-tiny)")
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=CHOICES, help="runs to compare (none = bf16)")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per row of the shards and the model")
    ap.add_argument("--tail", type=int, default=TAIL, help="steps averaged for the final training loss")
    ap.add_argument("--tol", type=float, default=TOL, help="bound on each final loss's relative difference from bf16")
    ap.add_argument("--corpus", default=None, help="a folder of .txt files (default: the shared chapters)")
    ap.add_argument("--png", default=str(REPO / "benchmarks" / "figures" / "fp8_curves.png"))
    ap.add_argument("--window", type=int, default=25, help="steps per point of the printed curves")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override key=value")
    ap.add_argument("--run", choices=CHOICES, help="only this run (with --save)")
    ap.add_argument("--save", help="a folder to save each run's losses in (<fp8>.json)")
    ap.add_argument("--report", help="compare the runs saved in this folder, run nothing")
    a = ap.parse_args(argv)
    if not a.run and not a.report and "none" not in a.runs:
        ap.error("--runs must include none (the bf16 run every other run is compared with)")
    if a.steps < 1 or a.tail < 1 or a.seq_len < 1 or not a.tol > 0:
        ap.error("--steps, --tail and --seq-len must be >= 1 and --tol > 0")
    from tqdm import tqdm

    if a.report:
        summaries = load_saved(Path(a.report))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            shards = build_shards(corpus_files(a.corpus, chapters=None), root, vocab=4096, seq_len=a.seq_len,
                                  val_fraction=0.05, shard_size=1024)
            summaries = {}
            for fp8 in tqdm([a.run] if a.run else a.runs, desc="runs"):
                summaries[fp8] = train_run(shards, root / f"run-{fp8}", fp8, a.steps, a.overrides, Path(a.config),
                                           a.seq_len)
                if a.save:
                    save(summaries[fp8], Path(a.save) / f"{fp8}.json")
        if a.run:
            return 0
    ok = report(summaries, a.window, a.tail, a.tol)
    plot(summaries, a.window, Path(a.png), f"{Path(a.config).stem}: FP8 vs bf16, {a.steps} steps")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
