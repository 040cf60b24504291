"""Loader benchmark: tokens per second delivered to one process from local shards, the first-touch cost of a shard,
and the rows each rank reads per step under tensor and pipeline parallelism.

Measures ShardLoader (random global order over all rows, LongTensor batches) with and without the prefetch thread,
for dp = 1 and for one rank of dp = 4, plus the validation iterator. Target: >= 10M tokens/s per process. Without
--shards it first builds shards of the chapters corpus (vocab-4096 tokenizer). Usage (from the repository root):

    python benchmarks/data_prep_loader.py [--shards SHARD_DIR] [--global-batch 64] [--steps 300]
    python benchmarks/data_prep_loader.py --first-touch [--rows-per-shard 8192] [--seq-len 2048]
    python benchmarks/data_prep_loader.py --rows-read [--steps 4]

--first-touch writes one shard of --rows-per-shard random rows and times opening it and reading one row, side by
side and alternating (the median of --repeats each): "scan", the tar walk with Python tarfile that indexed every
shard before the manifest held the member offsets (data_prep.reindex's scan, the code the reader ran), against
"offsets", today's reader (manifest offsets, one vectorised check of the member headers). Both read the page-cached
file. --rows-read spawns 4 gloo processes, builds tp2 x dp2 and pp2 x dp2 layouts over them, and reads --steps
global batches of the tiny test shards (built from the chapters) through the trainer's ShardData twice: every rank
reading its rows itself (before) and one reader per data-parallel replica (after), without prefetch (so the count is
of the batches taken); it prints the rows each rank read per step (the ranks of a replica hold the rows that
deal_by_depth gave it, G/dp = 8 on average) and checks that both give every rank bitwise the same tokens.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data_prep.loader import ShardLoader, validation_batches  # noqa: E402  (after the path set-up)
from data_prep.prepare import ShardOptions, prepare_shards  # noqa: E402
from data_prep.tokenizer import train_tokenizer  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", default=None, help="shard directory (default: build one from the chapters)")
    parser.add_argument("--corpus", default=str(REPO.parent / "shared" / "data" / "corpus" / "chapters"))
    parser.add_argument("--seq-len", type=int, default=2048, help="for the shards built when --shards is absent")
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=None, help="default 300 (4 with --rows-read)")
    parser.add_argument("--first-touch", action="store_true", help="time the first touch of one shard")
    parser.add_argument("--rows-per-shard", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows-read", action="store_true", help="rows read per step per rank, tp2 x dp2, pp2 x dp2")
    return parser.parse_args(argv)


def build_shards(args, work: Path) -> Path:
    """Shards of the chapters corpus under `work`."""
    tok = train_tokenizer(args.corpus, work / "tok", 4096, progress=False)
    prepare_shards(args.corpus, tok.directory, work / "shards",
                   ShardOptions(seq_len=args.seq_len, shard_size=256, workers=1, progress=False))
    return work / "shards"


def measure(shards: Path, global_batch: int, dp_size: int, prefetch: int, steps: int) -> tuple[float, float]:
    """(tokens/s over `steps` batches of rank 0, seconds to the first batch)."""
    start = time.perf_counter()
    loader = ShardLoader(shards, global_batch, 0, dp_size, seed=1, prefetch=prefetch)
    batches = iter(loader)
    first = next(batches)
    first_seconds = time.perf_counter() - start
    tokens, start = 0, time.perf_counter()
    for batch in itertools.islice(batches, steps):
        tokens += batch["tokens"].numel()
    seconds = time.perf_counter() - start
    loader.close()
    assert first["tokens"].shape[0] == global_batch // dp_size
    return tokens / seconds, first_seconds


def first_touch(rows: int, seq_len: int, repeats: int) -> dict[str, float]:
    """Median seconds to open one shard of `rows` rows and read one row: tar scan (before) and offsets (now)."""
    import numpy as np

    from data_prep.reindex import scanned_layout
    from data_prep.shard_reader import ShardRows
    from data_prep.shard_writer import SplitShardWriter

    with tempfile.TemporaryDirectory(prefix="first_touch_") as scratch:
        writer = SplitShardWriter(Path(scratch), "train", rows, seq_len + 1, np.uint16)
        writer.add_rows(np.random.default_rng(0).integers(0, 4096, (rows, seq_len + 1), dtype=np.uint16))
        entry = writer.close()[0]
        path = Path(scratch) / entry["name"]
        times: dict[str, list[float]] = {"scan": [], "offsets": [], "scan cpu": [], "offsets cpu": []}
        for _ in range(repeats):
            start, cpu = time.perf_counter(), time.process_time()
            layout = scanned_layout(path, entry, seq_len + 1, np.uint16)   # what every reader did on first touch
            ShardRows(path, {**entry, **layout}, seq_len + 1, np.uint16, 4096).read(np.array([rows // 2]))
            times["scan"].append(time.perf_counter() - start)
            times["scan cpu"].append(time.process_time() - cpu)
            start, cpu = time.perf_counter(), time.process_time()
            ShardRows(path, entry, seq_len + 1, np.uint16, 4096).read(np.array([rows // 2]))
            times["offsets"].append(time.perf_counter() - start)
            times["offsets cpu"].append(time.process_time() - cpu)
        assert layout == {"data_offset": entry["data_offset"], "stride": entry["stride"]}
    return {name: float(np.median(values)) for name, values in times.items()}


LAYOUTS = ((2, 1, 2), (1, 2, 2))  # (tp, pp, dp) over 4 processes
TINY_OVERRIDES = ["model.vocab_size=512", "model.d_model=64", "model.n_heads=2", "model.ve_gate_channels=16",
                  "model.seq_len=32", "data.micro_batch_size=2", "data.global_batch_size=16"]


def replica_reads_worker(rank: int, world: int, shards: str, steps: int, out_dir: str, layouts=LAYOUTS) -> None:
    """On each of `layouts`: `steps` batches of the trainer's ShardData read by every rank (before) and by one
    reader per replica (after); saves {layout: {before, after (rows read), rows, equal}} to out_dir/rank.pt."""
    import torch

    from megaloop.config import load_config
    from megaloop.train.data import ShardData
    from pipeline.layout import init_layout

    cfg = load_config(REPO / "configs" / "parcae-tiny.yaml", [f"data.shards={shards}", *TINY_OVERRIDES])
    results = {}
    for tp, pp, dp in layouts:
        layout = init_layout(tp=tp, pp=pp, dp=dp)
        before, after = ShardData(cfg, layout.dp_rank, dp), ShardData(cfg, layout.dp_rank, dp, layout)
        before.loader.prefetch = after.loader.prefetch = 0  # count the rows of the batches taken, none read ahead
        old, new = before.train_batches(), after.train_batches()
        equal, rows = True, 0
        for _ in range(steps):
            a, b = next(old)["tokens"], next(new)["tokens"]
            equal, rows = equal and torch.equal(a, b.cpu()), rows + len(a)
        results[tp, pp, dp] = {"before": before.rows_read, "after": after.rows_read, "rows": rows, "equal": equal,
                               "coords": (layout.tp_rank, layout.pp_rank, layout.dp_rank)}
        before.close()
        after.close()
    torch.save(results, Path(out_dir) / f"{rank}.pt")


def rows_read(shards: Path, steps: int) -> dict:
    """{(tp, pp, dp): [per rank: {before, after, rows, equal, coords}]} from 4 spawned gloo processes."""
    import socket

    import torch
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="rows_read_") as out:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        mp.spawn(_rows_read_entry, args=(4, port, str(shards), steps, out), nprocs=4, join=True)
        ranks = [torch.load(Path(out) / f"{rank}.pt") for rank in range(4)]
    return {layout: [r[layout] for r in ranks] for layout in LAYOUTS}


def _rows_read_entry(rank: int, world: int, port: int, shards: str, steps: int, out: str) -> None:
    import torch

    from pipeline.layout import destroy_layout

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        replica_reads_worker(rank, world, shards, steps, out)
    finally:
        destroy_layout(barrier=False)


def tiny_shards(work: Path, corpus: Path) -> Path:
    """The tests' tiny shards: 33-token rows from 24 chapters, vocab 512."""
    import shutil

    (work / "corpus").mkdir()
    for f in sorted(corpus.glob("*.txt"))[:24]:
        shutil.copy(f, work / "corpus" / f.name)
    tok = train_tokenizer(work / "corpus", work / "tok", 512, progress=False)
    prepare_shards(work / "corpus", tok.directory, work / "shards",
                   ShardOptions(seq_len=32, val_fraction=0.1, shard_size=256, progress=False))
    return work / "shards"


def print_rows_read(results: dict, steps: int) -> None:
    for (tp, pp, dp), ranks in results.items():
        cells = "  ".join(f"rank {i} (tp {r['coords'][0]} pp {r['coords'][1]} dp {r['coords'][2]}): "
                          f"{r['before'] / steps:g} -> {r['after'] / steps:g}" for i, r in enumerate(ranks))
        total_before = sum(r["before"] for r in ranks) / steps
        total_after = sum(r["after"] for r in ranks) / steps
        same = "bitwise equal" if all(r["equal"] for r in ranks) else "DIFFERENT"
        print(f"tp{tp} x pp{pp} x dp{dp}, rows read per step per rank, before -> after: {cells}; all ranks "
              f"{total_before:g} -> {total_after:g}; tokens {same}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.first_touch:
        figures = first_touch(args.rows_per_shard, args.seq_len, args.repeats)
        print(f"first touch of one shard of {args.rows_per_shard} rows of {args.seq_len + 1} tokens (median of "
              f"{args.repeats}, page-cached, load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores): tar "
              f"scan {figures['scan'] * 1e3:.1f} ms wall ({figures['scan cpu'] * 1e3:.1f} ms CPU), manifest "
              f"offsets {figures['offsets'] * 1e3:.2f} ms wall ({figures['offsets cpu'] * 1e3:.2f} ms CPU); "
              f"{figures['scan'] / figures['offsets']:.0f}x wall, "
              f"{figures['scan cpu'] / figures['offsets cpu']:.0f}x CPU")
        return 0
    if args.rows_read:
        steps = args.steps or 4
        with tempfile.TemporaryDirectory(prefix="rows_read_shards_") as scratch:
            shards = Path(args.shards) if args.shards else tiny_shards(Path(scratch), Path(args.corpus))
            print_rows_read(rows_read(shards, steps), steps)
        return 0
    args.steps = args.steps or 300
    if args.shards:
        return run(args, Path(args.shards))
    with tempfile.TemporaryDirectory(prefix="data_prep_loader_") as scratch:
        return run(args, build_shards(args, Path(scratch)))


def run(args, shards: Path) -> int:
    """Measure and print the loader figures."""
    loader = ShardLoader(shards, args.global_batch)
    print(f"shards {shards.name}: {loader.num_rows} train rows of {loader.dataset.row_len} tokens "
          f"({loader.num_rows * loader.dataset.row_len / 1e6:.1f}M tokens); {args.steps} steps of global batch "
          f"{args.global_batch} (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")
    loader.close()
    slowest = None
    for dp_size, prefetch in ((1, 2), (1, 0), (4, 2)):
        rate, first = measure(shards, args.global_batch, dp_size, prefetch, args.steps)
        slowest = rate if slowest is None else min(slowest, rate)
        print(f"  dp={dp_size} rank 0, prefetch={prefetch}: {rate / 1e6:.1f}M tokens/s "
              f"(first batch after {first * 1e3:.0f} ms)")
    start, tokens = time.perf_counter(), 0
    for batch in validation_batches(shards, args.global_batch):
        tokens += int(batch["valid"].sum()) * batch["tokens"].shape[1]
    print(f"  validation iterator: {tokens / (time.perf_counter() - start) / 1e6:.1f}M tokens/s")
    print(f"slowest training configuration: {slowest / 1e6:.1f}M tokens/s per process; target >= 10M: "
          f"{'MET' if slowest >= 10e6 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
