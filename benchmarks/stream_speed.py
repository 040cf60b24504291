"""Loader speed from streamed shards, one node cache shared by 4 ranks, and the rate a large run needs.

1. Rows/s through ShardLoader (block order, batch prefetch thread, shard prefetch) from the local directory, from
   moto's S3 server and from a local HTTP server (fresh node caches), and from S3 again with the cache warm: all in
   one run, side by side, so that the ratios mean something on a shared machine; plus each one's first-batch latency
   (constructor to first batch: manifest read and the first block's downloads).
2. 4 processes (dp ranks of one node) read --steps global batches from the HTTP server into one cache directory:
   the server counts the GETs of each shard (each must be 1) and the processes' downloads add up to the shards read.
3. What parcae-1_3b needs per GPU at 45% MFU: FLOPs per token from `megaloop flops`, against an H100's dense bf16
   peak (989 TFLOP/s), as rows/s and bytes/s, beside what one loader process delivers here.

    python benchmarks/stream_speed.py [--steps 60] [--global-batch 32] [--seq-len 512] [--files 222]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stream_common import REPO, build_shards

from data_prep.loader import ShardLoader
from data_prep.local_servers import FileServer, S3Server
from data_prep.sources import StreamSource

H100_BF16_DENSE = 989e12


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--shard-size", type=int, default=128)
    p.add_argument("--files", type=int, default=222, help="chapter files in the corpus (default: all 222)")
    p.add_argument("--block-shards", type=int, default=4)
    return p.parse_args(argv)


def timed(source, args) -> dict:
    start = time.perf_counter()
    loader = ShardLoader(source, args.global_batch, seed=0, order="blocks", block_shards=args.block_shards,
                         prefetch=4, prefetch_steps=8)
    batches = iter(loader)
    next(batches)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(args.steps):
        next(batches)
    rows_per_s = args.steps * args.global_batch / (time.perf_counter() - start)
    stats = loader.dataset.source.stats()
    loader.close()
    return {"first": first, "rows_per_s": rows_per_s, **stats}


def rank_worker(url: str, cache: str, rank: int, args, out) -> None:
    loader = ShardLoader(StreamSource(url, cache), args.global_batch, rank, 4, seed=0, order="blocks",
                         block_shards=args.block_shards, prefetch=2)
    batches = iter(loader)
    for _ in range(args.steps):
        next(batches)
    loader.close()  # waits for the shard prefetches under way, so that their downloads are counted
    out.put(loader.dataset.source.stats()["downloads"])


def main(argv=None) -> int:
    args = parse_args(argv)
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shards = build_shards(tmp / "data", files=args.files, seq_len=args.seq_len, shard_size=args.shard_size,
                              vocab=4096)
        s3, http = S3Server(), FileServer(shards)
        url = s3.put_dir(shards, "corpus", "speed")
        row_bytes = (args.seq_len + 1) * 2
        print(f"{args.steps} steps of {args.global_batch} rows of {args.seq_len + 1} tokens, order=blocks "
              f"(block_shards={args.block_shards}), {args.shard_size} rows per shard")
        runs = {"local": str(shards),
                "s3 (cold cache)": StreamSource(url, tmp / "c-s3", s3_endpoint=s3.endpoint),
                "http (cold cache)": StreamSource(http.url, tmp / "c-http"),
                "s3 (warm cache)": StreamSource(url, tmp / "c-s3", s3_endpoint=s3.endpoint)}
        figures = {}
        for name, source in runs.items():
            figures[name] = f = timed(source, args)
            print(f"  {name:18s} first batch {f['first'] * 1e3:7.1f} ms, {f['rows_per_s']:9.0f} rows/s "
                  f"({f['rows_per_s'] * row_bytes / 1e6:6.1f} MB/s of tokens), {f['downloads']} downloads "
                  f"({f['bytes_downloaded'] / 1e6:.2f} MB), cache hit ratio {f['hit_ratio']:.2f}")
        print(f"  s3 cold / local rows/s: {figures['s3 (cold cache)']['rows_per_s'] / figures['local']['rows_per_s']:.2f}"
              f"; s3 warm / local: {figures['s3 (warm cache)']['rows_per_s'] / figures['local']['rows_per_s']:.2f}")

        http.hits.clear()
        queue = multiprocessing.get_context("spawn").Queue()
        procs = [multiprocessing.get_context("spawn").Process(target=rank_worker,
                                                              args=(http.url, str(tmp / "c-node"), r, args, queue))
                 for r in range(4)]
        for proc in procs:
            proc.start()
        downloads = [queue.get(timeout=600) for _ in procs]
        for proc in procs:
            proc.join()
        shard_gets = {k: v for k, v in http.hits.items() if k.endswith(".tar")}
        once = bool(shard_gets) and max(shard_gets.values()) == 1 and sum(downloads) == len(shard_gets)
        ok &= once
        print(f"4 ranks of one node, {args.steps} steps: {len(shard_gets)} shards read, GETs per shard at the "
              f"server: max {max(shard_gets.values())}; downloads per rank {downloads} (sum {sum(downloads)}): "
              f"each shard downloaded once: {once}")
        http.close()
        s3.close()

    flops = json.loads(subprocess.run([sys.executable, "-m", "megaloop", "flops", "configs/parcae-1_3b.yaml"],
                                      cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
                       .splitlines()[-1])
    tokens = 0.45 * H100_BF16_DENSE / flops["flops_per_token"]
    rows = tokens / 2048
    local = figures["local"]["rows_per_s"] * (args.seq_len + 1) / 2049
    print(f"parcae-1_3b at 45% MFU on an H100 ({H100_BF16_DENSE / 1e12:.0f} TFLOP/s dense bf16, "
          f"{flops['flops_per_token'] / 1e9:.2f} GFLOP/token): {tokens:,.0f} tokens/s = {rows:.1f} rows of 2049 "
          f"tokens/s = {rows * 2049 * 2 / 1e3:.0f} KB/s per GPU; one loader process here: "
          f"{local:,.0f} such rows/s from local, "
          f"{figures['s3 (cold cache)']['rows_per_s'] * (args.seq_len + 1) / 2049:,.0f} from moto S3 (cold)")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
