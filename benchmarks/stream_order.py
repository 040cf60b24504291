"""The same stream from every source, and the block-local order's mixing.

Serves one shard directory (the chapters, 24 files by default) from moto's S3 server and a local HTTP server on
127.0.0.1, and reads --steps global batches with the block-local order at dp 1, 2 and 4 from each source (every
rank of a dp its own loader and its own node cache, as separate processes would). Prints, per source and dp, whether
the row ids of every global batch equal the local directory's at dp 1. Then the mixing of each order: the mean
distance in the corpus between two rows of one global batch over its expectation for independent uniform rows
(data_prep.order.mixing; 1.0 = a full permutation) and the distinct shards a global batch touches.

    python benchmarks/stream_order.py [--steps 50] [--global-batch 32] [--block-shards 8] [--files 24]
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
from stream_common import build_shards

from data_prep.loader import ShardLoader
from data_prep.local_servers import FileServer, S3Server
from data_prep.order import mixing
from data_prep.sources import StreamSource


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--block-shards", type=int, default=8)
    p.add_argument("--files", type=int, default=24, help="chapter files in the corpus (default 24)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def global_ids(make_source, dp: int, args, order: str = "blocks") -> np.ndarray:
    """[steps, G] row ids of the global batches, the dp ranks' shares concatenated in rank order."""
    shares = []
    for rank in range(dp):
        loader = ShardLoader(make_source(rank), args.global_batch, rank, dp, seed=args.seed, order=order,
                             block_shards=args.block_shards, prefetch=2)
        batches = iter(loader)
        shares.append([next(batches)["row_id"].numpy() for _ in range(args.steps)])
        loader.close()
    return np.stack([np.concatenate([share[s] for share in shares]) for s in range(args.steps)])


def main(argv=None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shards = build_shards(tmp / "data", files=args.files)
        s3, http = S3Server(), FileServer(shards)
        s3_url = s3.put_dir(shards, "corpus", "chapters")
        try:
            reference = global_ids(lambda rank: str(shards), 1, args)
            print(f"{args.steps} global batches of {args.global_batch} rows, order=blocks "
                  f"(block_shards={args.block_shards}), seed {args.seed}; reference: the local directory at dp 1")
            sources = {"local": lambda run: (lambda rank: str(shards)),
                       "s3": lambda run: (lambda rank: StreamSource(s3_url, tmp / f"cache-s3-{run}-{rank}",
                                                                     s3_endpoint=s3.endpoint)),
                       "http": lambda run: (lambda rank: StreamSource(http.url, tmp / f"cache-http-{run}-{rank}"))}
            all_equal = True
            for name, factory in sources.items():
                for dp in (1, 2, 4):
                    ids = global_ids(factory(f"dp{dp}"), dp, args)
                    equal = bool(np.array_equal(ids, reference))
                    all_equal &= equal
                    print(f"  {name:5s} dp={dp}: row ids of all {args.steps} global batches equal: {equal} "
                          f"(first batch {ids[0][:6].tolist()}...)")
            n_rows = ShardLoader(str(shards), args.global_batch).num_rows
            print(f"mixing over {args.steps} global batches of the {n_rows}-row train split "
                  f"(1.0 = independent uniform rows):")
            for order in ("global", "blocks"):
                ids = global_ids(lambda rank: str(shards), 1, args, order)
                shard_of = ids // 256
                print(f"  order={order:6s}: mean pair distance / (N/3) = "
                      f"{np.mean([mixing(b, n_rows) for b in ids]):.3f}, distinct shards per global batch = "
                      f"{np.mean([len(set(b)) for b in shard_of]):.1f}")
        finally:
            http.close()
            s3.close()
    print("OK" if all_equal else "MISMATCH")
    return 0 if all_equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
