"""Step time and tokens/s of parcae-tiny under several parallel layouts on this machine's CPUs, side by side in one
run: each layout is one `torchrun -m megaloop train` job on the same shards, config and seed (gloo). Printed
honestly, with no target: on a few CPU cores, tensor parallelism mostly adds communication to a model this small.

    python benchmarks/parallel_layouts.py [--shards SHARD_DIR] [--steps 20] [--layouts 1,tp2,dp2,tp2xdp2,pp2]

Without --shards, a tokenizer and seq_len-128 shards of the bundled sample corpus are built in a temporary folder.
A layout is `1` or a product of `tpN`, `dpN` and `ppN` (e.g. `tp2xdp2`, `pp2xdp2`); each process runs with
OMP_NUM_THREADS=1. The first --warmup steps of each run are left out of the median step time.

A pipeline layout (ppN, the ring pipeline) needs at least N core blocks (parcae-tiny has 2: for pp4 pass
`--set model.n_core=4`, which then holds for every layout) and at least N micro-batches per data-parallel rank: where
the config's data.micro_batch_size gives fewer, that layout runs with the largest micro-batch size that gives N (the
global batch stays the same); the table prints each layout's micro-batch size.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
CONFIG = REPO / "configs" / "parcae-tiny.yaml"


def parse_layout(text: str) -> tuple[int, int, int]:
    """'1' -> (1, 1, 1); 'tp2xdp2' -> (2, 2, 1); 'pp2xdp2' -> (1, 2, 2): (tp, dp, pp)."""
    if text == "1":
        return 1, 1, 1
    sizes = {"tp": 1, "dp": 1, "pp": 1}
    for part in text.split("x"):
        m = re.fullmatch(r"(tp|dp|pp)(\d+)", part)
        if not m or int(m.group(2)) < 1:
            raise SystemExit(f"layout {text!r}: use 1 or parts tpN / dpN / ppN joined by x, e.g. tp2xdp2 or pp2xdp2")
        sizes[m.group(1)] = int(m.group(2))
    return sizes["tp"], sizes["dp"], sizes["pp"]


def micro_batch_size(label: str, overrides: list[str]) -> int:
    """The micro-batch size layout `label` runs with: the config's, or for a ppN layout whose data-parallel rank
    would get fewer than N micro-batches, the largest size that gives N (SystemExit when none does, or when the core
    has fewer than N blocks)."""
    from megaloop.config import load_config

    tp, dp, pp = parse_layout(label)
    cfg = load_config(str(CONFIG), overrides)
    micro, rows = cfg.data.micro_batch_size, cfg.data.global_batch_size // dp
    if pp > cfg.model.n_core:
        raise SystemExit(f"layout {label}: the core has {cfg.model.n_core} blocks, fewer than pp={pp} stages; pass "
                         f"--set model.n_core={pp} (or more)")
    if pp == 1 or rows // micro >= pp:
        return micro
    fits = [b for b in range(rows // pp, 0, -1) if rows % b == 0]
    if not fits:
        raise SystemExit(f"layout {label}: {rows} rows per data-parallel rank cannot make {pp} micro-batches; pass "
                         f"--set data.global_batch_size={pp * dp * micro}")
    return fits[0]


def build_shards(root: Path) -> Path:
    py = sys.executable
    corpus = REPO / "data" / "sample_corpus"
    subprocess.run([py, "-m", "data_prep", "tokenizer", "--input", str(corpus), "--output", str(root / "tok"),
                    "--vocab-size", "4096"], check=True, cwd=REPO)
    subprocess.run([py, "-m", "data_prep", "shards", "--input", str(corpus), "--tokenizer", str(root / "tok"),
                    "--output", str(root / "shards"), "--seq-len", "128"], check=True, cwd=REPO)
    return root / "shards"


def run_layout(label: str, shards: Path, steps: int, out: Path, overrides: list[str], micro: int) -> list[dict]:
    tp, dp, pp = parse_layout(label)
    world = tp * dp * pp
    sets = [f"data.shards={shards}", f"train.steps={steps}", f"train.out_dir={out}", "train.progress=false",
            f"train.val_every={steps}", "train.val_depths=[4]", f"parallel.tp={tp}", f"parallel.dp={dp}",
            f"parallel.pp={pp}", *overrides, f"data.micro_batch_size={micro}"]
    args = [a for s in sets for a in ("--set", s)]
    if world == 1:
        cmd = [sys.executable, "-m", "megaloop", "train", str(CONFIG), *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               "-m", "megaloop", "train", str(CONFIG), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"layout {label} failed ({' '.join(cmd)}):\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == "train"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", help="a shard directory matching parcae-tiny (seq_len 128); default: built")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the median")
    ap.add_argument("--layouts", default="1,tp2,dp2,tp2xdp2")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="extra config override")
    a = ap.parse_args()
    if a.steps <= a.warmup:
        raise SystemExit(f"--steps ({a.steps}) must exceed --warmup ({a.warmup})")
    layouts = a.layouts.split(",")
    micro = {label: micro_batch_size(label, a.overrides) for label in layouts}
    with tempfile.TemporaryDirectory() as tmp:
        shards = Path(a.shards) if a.shards else build_shards(Path(tmp))
        rows = []
        for label in layouts:
            train = run_layout(label, shards, a.steps, Path(tmp) / f"run-{label}", a.overrides, micro[label])
            times = [r["time_step"] for r in train[a.warmup:]]
            tokens_per_step = train[-1]["tokens"]  # global tokens of one step
            step = statistics.median(times)
            rows.append((label, len(train), step, tokens_per_step / step, train[-1]["loss"]))
    print(f"parcae-tiny, {a.steps} steps (median of steps {a.warmup}..{a.steps - 1}), {os.cpu_count()} CPU cores, "
          f"one thread per process")
    print(f"{'layout':>12} {'processes':>9} {'micro':>5} {'step time':>10} {'tokens/s':>9} {'last loss':>9}")
    for label, _, step, tps, loss in rows:
        tp, dp, pp = parse_layout(label)
        print(f"{label:>12} {tp * dp * pp:>9} {micro[label]:>5} {step * 1000:>8.0f}ms {tps:>9,.0f} {loss:>9.4f}")


if __name__ == "__main__":
    main()
