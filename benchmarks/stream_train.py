"""Training from streamed shards: exact resume, injected faults, a store that stays down.

parcae-tiny (fp32, one process, 1 thread, per-sequence depths, Muon + AdamW) on the chapters shards with the
block-local order, as tests/train/test_checkpoint_resume.py runs it:

1. 40 steps from the local directory; 40 from moto's S3; 20 from S3, stopped (train.stop_at_step) and re-run to
   40 (resumed from the checkpoint, another node cache): the three loss lists must be bitwise equal.
2. 40 steps from an HTTP server that answers 20% of its requests with a 503 or a reset connection, in the global
   order (which touches every shard within a few steps: many requests): the losses of the local global-order run.
3. `python -m megaloop train` from HTTP with checkpoint.every=10; the server goes down for good once the step-10
   checkpoint is committed, and the next shard the run needs is not in the cache (data.block_shards=1, so a new
   shard every ~21 steps): the run must exit non-zero with an error naming the URL, and its newest committed
   checkpoint must still load.

    python benchmarks/stream_train.py [--steps 40] [--stop-at 20]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from stream_common import REPO, build_shards

os.environ.setdefault("OMP_NUM_THREADS", "1")
TINY = REPO / "configs" / "parcae-tiny.yaml"


def overrides(shards, out_dir, steps: int, *extra: str) -> list[str]:
    return [f"data.shards={shards}", f"train.out_dir={out_dir}", f"train.steps={steps}", "model.vocab_size=512",
            "model.seq_len=32", "data.micro_batch_size=2", "data.global_batch_size=12", "data.val_batches=1",
            "train.val_every=1000", "train.progress=false", "train.precision=fp32", "train.val_depths=[2]",
            "data.order=blocks", "data.block_shards=4", *extra]


def train(shards, out_dir, steps: int, *extra: str):
    import torch

    from megaloop.config import load_config
    from megaloop.train.loop import train as run
    from megaloop.train.runtime import SingleProcessRuntime

    torch.set_num_threads(1)
    return run(load_config(str(TINY), overrides(shards, out_dir, steps, *extra)),
               runtime=SingleProcessRuntime(torch.device("cpu")))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--stop-at", type=int, default=20)
    args = p.parse_args(argv)
    from data_prep.local_servers import FileServer, S3Server

    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        shards = build_shards(tmp / "data")
        s3 = S3Server()
        url = s3.put_dir(shards, "corpus", "chapters")
        endpoint = f"data.s3_endpoint={s3.endpoint}"
        local = train(shards, tmp / "local", args.steps)
        straight = train(url, tmp / "s3", args.steps, endpoint, f"data.cache_dir={tmp / 'cache-a'}")
        first = train(url, tmp / "s3-resumed", args.steps, endpoint, f"data.cache_dir={tmp / 'cache-b'}",
                      f"train.stop_at_step={args.stop_at}")
        second = train(url, tmp / "s3-resumed", args.steps, endpoint, f"data.cache_dir={tmp / 'cache-c'}")
        resumed = first.losses + second.losses
        print(f"1. {args.steps} steps, losses {local.losses[0]:.6f} .. {local.losses[-1]:.6f} (local); S3 straight "
              f"bitwise equal to local: {straight.losses == local.losses}; S3 stopped at {args.stop_at} "
              f"(start_step {second.start_step}) and resumed: bitwise equal: {resumed == straight.losses}; "
              f"S3 run downloaded {straight.data_bytes_downloaded} bytes, cache hit ratio "
              f"{straight.data_cache_hit_ratio:.3f}, loader wait {straight.data_wait_s:.3f} s in total")
        ok &= straight.losses == local.losses and resumed == straight.losses and second.start_step == args.stop_at
        s3.close()

        server = FileServer(shards, fail_rate=0.2, seed=1)
        local_global = train(shards, tmp / "local-global", args.steps, "data.order=global")
        faulty = train(server.url, tmp / "faulty", args.steps, f"data.cache_dir={tmp / 'cache-d'}",
                       "data.retry_backoff_s=0.05", "data.order=global")
        hits = sum(server.hits.values())
        print(f"2. HTTP, global order, {server.failures} of {hits} requests failed (503 or reset): losses bitwise "
              f"equal to the local run's: {faulty.losses == local_global.losses}")
        ok &= faulty.losses == local_global.losses and server.failures > 0
        server.close()

        ok &= server_down(shards, tmp)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


def server_down(shards: Path, tmp: Path) -> bool:
    from checkpoints.load import CheckpointReader, find_checkpoints
    from data_prep.local_servers import FileServer

    server = FileServer(shards)
    out = tmp / "down"
    command = [sys.executable, "-m", "megaloop", "train", str(TINY)]
    for item in overrides(server.url, out, 80, f"data.cache_dir={tmp / 'cache-e'}", "data.block_shards=1",
                          "data.prefetch_steps=2", "checkpoint.every=10", "checkpoint.async_save=false",
                          "data.retries=3", "data.retry_backoff_s=0.2"):
        command += ["--set", item]
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})

    def take_down():
        while proc.poll() is None:
            found = find_checkpoints(out / "checkpoints") if (out / "checkpoints").is_dir() else []
            if found:
                server.down()
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=take_down)
    watcher.start()
    stdout, stderr = proc.communicate(timeout=600)
    watcher.join()
    found = find_checkpoints(out / "checkpoints")
    reader = CheckpointReader(found[0])
    names = [n for n in reader.arrays if n.startswith("model/")]
    loads = all(reader.read(n) is not None for n in names)
    error = [line for line in stderr.splitlines() if "megaloop:" in line][-1:]
    print(f"3. server down after the step-10 checkpoint: exit code {proc.returncode}; {error[0] if error else '?'}; "
          f"newest committed checkpoint: step {reader.step}, its {len(names)} model arrays load: {loads}")
    return proc.returncode not in (0, 75) and loads and bool(error) and server.url in error[0]


if __name__ == "__main__":
    raise SystemExit(main())
