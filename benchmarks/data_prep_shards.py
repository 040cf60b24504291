"""Sharding benchmark: the whole shared corpus end to end, MB/s of text, checksums verified.

Needs a tokenizer directory (e.g. from benchmarks/data_prep_tokenizer.py --output DIR). Prints MB/s (target >= 5 on
the 2-core development machine), then verifies every shard's sha256 against the manifest. With --compare-workers N
it shards again with N workers and checks the outputs are byte-identical. Usage (from the repository root):

    python benchmarks/data_prep_shards.py --tokenizer TOK_DIR [--corpus ../shared/data/corpus] [--seq-len 2048]
        [--workers 2] [--output DIR] [--compare-workers 1]
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from data_prep.manifest import read_manifest, verify_shards  # noqa: E402  (after the path set-up)
from data_prep.prepare import ShardOptions, prepare_shards  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True)
    parser.add_argument("--corpus", default=str(REPO.parent / "shared" / "data" / "corpus"))
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--shard-size", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--output", default=None, help="shard directory to keep (default: a temporary one)")
    parser.add_argument("--compare-workers", type=int, default=None,
                        help="also shard with this many workers and compare the bytes")
    return parser.parse_args(argv)


def cpu_seconds() -> float:
    """CPU time of this process and of its finished children (the worker processes), user + system."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def shard_once(args, output: Path, workers: int) -> tuple[dict, float, float]:
    """Run prepare_shards; returns (manifest, wall seconds, CPU seconds of this process and its workers)."""
    options = ShardOptions(seq_len=args.seq_len, shard_size=args.shard_size, workers=workers, overwrite=True,
                           progress=False)
    cpu_start, start = cpu_seconds(), time.perf_counter()
    manifest = prepare_shards(args.corpus, args.tokenizer, output, options)
    return manifest, time.perf_counter() - start, cpu_seconds() - cpu_start


def same_bytes(first: Path, second: Path) -> bool:
    """True when both directories hold the same files with the same bytes."""
    files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    other = sorted(p.relative_to(second) for p in second.rglob("*") if p.is_file())
    return files == other and all((first / f).read_bytes() == (second / f).read_bytes() for f in files)


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="data_prep_shards_") as scratch:
        return run(args, Path(args.output) if args.output else Path(scratch) / "shards", Path(scratch))


def run(args, output: Path, scratch: Path) -> int:
    """Shard into `output` (and into `scratch` for the comparison), print the figures; 0 when all checks pass."""
    manifest, seconds, cpu = shard_once(args, output, args.workers)
    mb = manifest["counts"]["text_bytes"] / 1e6
    print(f"sharded {mb:.1f} MB of text ({manifest['counts']['files_used']} files) into "
          f"{sum(len(s['shards']) for s in manifest['splits'].values())} shards at {output}")
    for split, info in sorted(manifest["splits"].items()):
        print(f"  {split}: {info['rows']} rows of {manifest['row_len']} tokens, {info['documents']} documents")
    print(f"time {seconds:.1f} s wall with {args.workers} worker(s) (load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores): {mb / seconds:.2f} MB/s; target >= 5 MB/s: "
          f"{'MET' if mb / seconds >= 5 else 'MISSED'}")
    print(f"CPU {cpu:.1f} s (this process + workers): {mb / cpu:.2f} MB per CPU-second, so about "
          f"{min(args.workers, os.cpu_count() or 1) * mb / cpu:.1f} MB/s when {args.workers} cores are free")
    start = time.perf_counter()
    problems = verify_shards(output, read_manifest(output), "full")
    print(f"manifest checksums (full sha256): {'all OK' if not problems else problems} "
          f"({time.perf_counter() - start:.1f} s)")
    if args.compare_workers is not None:
        other = scratch / "compare"
        _, other_seconds, _ = shard_once(args, other, args.compare_workers)
        identical = same_bytes(output, other)
        print(f"with {args.compare_workers} worker(s): {mb / other_seconds:.2f} MB/s; byte-identical output: "
              f"{identical}")
        problems = problems or ({} if identical else {"compare": "outputs differ"})
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
