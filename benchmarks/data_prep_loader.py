"""Loader benchmark: tokens per second delivered to one process from local shards.

Measures ShardLoader (random global order over all rows, LongTensor batches) with and without the prefetch thread,
for dp = 1 and for one rank of dp = 4, plus the validation iterator. Target: >= 10M tokens/s per process. Without
--shards it first builds shards of the chapters corpus (vocab-4096 tokenizer). Usage (from the repository root):

    python benchmarks/data_prep_loader.py [--shards SHARD_DIR] [--global-batch 64] [--steps 300]
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
    parser.add_argument("--steps", type=int, default=300)
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


def main(argv=None) -> int:
    args = parse_args(argv)
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
