"""FP8 against bf16 in training: parcae-tiny for 300 steps with train.fp8 none (bf16), tensorwise and rowwise, on
the same data and seed. Prints the loss curves (mean over each window of steps), the final training loss (mean of
the last 20 steps: one step's loss is one batch's) and the validation loss at each depth, with each FP8 run's
relative difference from bf16, and writes a PNG of the curves.

    python benchmarks/fp8_curves.py [--steps 300] [--corpus DIR] [--png FILE] [--set key=value ...]
    python benchmarks/fp8_curves.py --run tensorwise --save DIR   # one run only, its results saved in DIR
    python benchmarks/fp8_curves.py --report DIR                  # the comparison of the runs saved in DIR

(--run/--save let the three runs go in parallel processes; each builds the same shards from the same corpus.)

The shards are built here (vocab 4096, 128-token rows) from --corpus, else the shared corpus's chapters, else the
bundled sample corpus. On a CPU the FP8 GEMMs run through torch._scaled_mm's CPU kernel: the figures are about
numerics, not speed."""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.corpus_shards import build_shards, corpus_files  # noqa: E402

RUNS = ("none", "tensorwise", "rowwise")
TAIL = 20  # steps averaged for the final training loss
TOL = 0.015  # the acceptance bound: final train and val losses within 1.5% of bf16's


def train_run(shards: Path, out: Path, fp8: str, steps: int, extra: list[str]):
    from megaloop.config import load_config
    from megaloop.train.loop import train

    cfg = load_config(str(REPO / "configs" / "parcae-tiny.yaml"),
                      [f"data.shards={shards}", f"train.out_dir={out}", f"train.steps={steps}", "train.precision=bf16",
                       f"train.fp8={fp8}", f"train.val_every={steps}", "checkpoint.async_save=false", *extra])
    return train(cfg)


def windows(losses: list[float], width: int) -> list[tuple[int, float]]:
    return [(i + width, sum(losses[i:i + width]) / len(losses[i:i + width])) for i in range(0, len(losses), width)]


def report(summaries: dict, width: int) -> bool:
    curves = {name: windows(s.losses, width) for name, s in summaries.items()}
    print("step   " + "  ".join(f"{('bf16' if n == 'none' else 'fp8 ' + n):>16s}" for n in summaries))
    for i, (step, _) in enumerate(curves["none"]):
        print(f"{step:5d}  " + "  ".join(f"{curves[n][i][1]:16.4f}" for n in summaries))
    base = summaries["none"]
    base_train = sum(base.losses[-TAIL:]) / TAIL
    ok = True
    for name, s in summaries.items():
        train_loss = sum(s.losses[-TAIL:]) / TAIL
        rel = (train_loss - base_train) / base_train
        vals = {t: v["val_loss"] for t, v in sorted(s.val.items())}
        val_rel = {t: (v - base.val[t]["val_loss"]) / base.val[t]["val_loss"] for t, v in vals.items()}
        label = "bf16" if name == "none" else f"fp8 {name}"
        print(f"{label:16s} final train loss (mean of last {TAIL}) {train_loss:.4f} ({rel:+.2%} vs bf16); val "
              + ", ".join(f"T={t}: {v:.4f} ({val_rel[t]:+.2%})" for t, v in vals.items()))
        ok &= abs(rel) <= TOL and all(abs(r) <= TOL for r in val_rel.values())
    print(f"every final loss within {TOL:.1%} of bf16's: {ok}")
    return ok


def plot(summaries: dict, width: int, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, s in summaries.items():
        xs, ys = zip(*windows(s.losses, width))
        ax.plot(xs, ys, label="bf16" if name == "none" else f"FP8 {name} (core)")
    ax.set_xlabel("step")
    ax.set_ylabel(f"training loss (mean over {width} steps)")
    ax.set_title("parcae-tiny: FP8 vs bf16 (CPU)")
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
    for fp8 in RUNS:
        data = json.loads((root / f"{fp8}.json").read_text())
        out[fp8] = SimpleNamespace(losses=data["losses"], val={int(t): v for t, v in data["val"].items()})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--corpus", default=None, help="a folder of .txt files (default: the shared chapters)")
    ap.add_argument("--png", default=str(REPO / "benchmarks" / "figures" / "fp8_curves.png"))
    ap.add_argument("--window", type=int, default=25, help="steps per point of the printed curves")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="config override key=value")
    ap.add_argument("--run", choices=RUNS, help="only this run (with --save)")
    ap.add_argument("--save", help="a folder to save each run's losses in (<fp8>.json)")
    ap.add_argument("--report", help="compare the runs saved in this folder, run nothing")
    a = ap.parse_args(argv)
    from tqdm import tqdm

    if a.report:
        summaries = load_saved(Path(a.report))
    else:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            shards = build_shards(corpus_files(a.corpus, chapters=None), root, vocab=4096, seq_len=128,
                                  val_fraction=0.05, shard_size=1024)
            summaries = {}
            for fp8 in tqdm([a.run] if a.run else RUNS, desc="runs"):
                summaries[fp8] = train_run(shards, root / f"run-{fp8}", fp8, a.steps, a.overrides)
                if a.save:
                    save(summaries[fp8], Path(a.save) / f"{fp8}.json")
        if a.run:
            return 0
    ok = report(summaries, a.window)
    plot(summaries, a.window, Path(a.png))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
