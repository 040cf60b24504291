"""Data-parallel buckets and the overlapped ZeRO-1 parameter all-gather.

    python benchmarks/dp_overlap.py [--dp 4] [--steps 12] [--bucket-elements 262144] [--skip-measure]

1. Buckets per gradient reduction (and per parameter all-gather) of parcae-1_3b's fp32 gradient buffer at dp 8 to
   128 (tp = pp = 1): the former fixed 25 MiB buckets against the max(40M, 1M x dp)-element buckets the runtime
   builds over its buffer groups, with the bytes of each rank's piece of one collective (a ring moves about that
   much per step of the collective).
2. Measured on CPU with gloo at dp 4: the fraction of the parameter all-gather's time hidden behind the next
   forward. parcae-tiny (fp32, fixed depth) trains through the trainer's own train_step in one set of processes,
   alternating steps with the gather overlapped and not (the same runtime, the flag switched between steps, so
   both see the same machine load). The gather's own calls are timed on the training thread (ParamGather.busy_s:
   launching and waiting). Not overlapped, that is the whole gather: launch every bucket and wait for each. Overlapped,
   it is only what the training thread still spends on it: the launches after the optimizer step and the waits in
   the forward pre-hooks and before the first backward. hidden = 1 - overlapped / not overlapped, medians over the
   steps, the slowest rank's figure. --bucket-elements is small so that the tiny model has several buckets.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

OLD_BUCKET_BYTES = 25 * 2**20


def bucket_table(dps: list[int]) -> None:
    from megaloop.config import load_config
    from megaloop.plan.dp_buckets import planned_buckets
    from megaloop.plan.layout import local_params
    from pipeline.data_parallel import bucket_count, default_bucket_elements

    cfg = load_config(REPO / "configs/parcae-1_3b.yaml")
    params = local_params(cfg, 1)
    n = sum(p.local_numel for p in params)
    print(f"parcae-1_3b: {n:,} parameters, fp32 gradient buffer, buckets per reduction (and per all-gather): the old "
          "fixed 25 MiB over one flat buffer, and the buckets the runtime builds today (its buffer groups, padding "
          "included; megaloop/plan/dp_buckets.py)")
    print(f"{'dp':>5}{'25 MiB buckets':>16}{'piece/rank':>12}{'max(40M, 1M x dp)':>19}{'largest piece/rank':>20}")
    for dp in dps:
        chunk = -(-n // dp)
        old = bucket_count(chunk, dp, OLD_BUCKET_BYTES // 4)
        old_piece = min(chunk, OLD_BUCKET_BYTES // 4 // dp) * 4
        new = planned_buckets(params, dp, 1, True, default_bucket_elements(dp), "backward", 1, 1)
        new_piece = max(b.elements for b in new) // dp * 4
        print(f"{dp:>5}{old:>16}{old_piece / 2**20:>10.2f}Mi{len(new):>19}{new_piece / 2**20:>18.2f}Mi")


def _rank(rank: int, world: int, port: int, steps: int, bucket_elements: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    import torch

    from megaloop.config import load_config
    from megaloop.depth import make_sampler
    from megaloop.train.flops import FlopModel
    from megaloop.train.loop import build_model_and_optimizer
    from megaloop.train.runtime import make_runtime
    from megaloop.train.step import train_step

    torch.set_num_threads(1)
    cfg = load_config(REPO / "configs/parcae-tiny.yaml",
                      ["model.depth_sampler=fixed", "train.progress=false", "train.precision=fp32",
                       f"parallel.dp={world}", f"parallel.grad_bucket_elements={bucket_elements}",
                       "data.micro_batch_size=2", f"data.global_batch_size={4 * world}"])
    m, device = cfg.model, torch.device("cpu")
    rows = cfg.data.global_batch_size // world
    sampler = make_sampler("fixed", m.mu_rec, m.backprop_depth, seed=0)
    runtime = make_runtime(cfg, device)
    model, optimizer = build_model_and_optimizer(cfg, runtime, device)
    gather = optimizer.parts.gather
    gen = torch.Generator().manual_seed(runtime.dp_rank)
    import time

    import torch.distributed as dist

    times = {True: [], False: []}
    walls = {True: [], False: []}
    for step in range(4 * steps + 4):
        # blocks of two steps in one mode: the second step's gather calls are the cost of one gather in that mode
        # (overlapped: the wait for the first step's gather in its forward + launching its own)
        overlap = (step // 2) % 2 == 0
        runtime.overlap_param_gather = overlap
        dist.barrier()  # ranks start the step together: a wait for a late rank is not counted as gather time
        before, t0 = gather.busy_s, time.perf_counter()
        index = torch.arange(rows) + runtime.dp_rank * rows + step * cfg.data.global_batch_size
        batch = {"tokens": torch.randint(0, m.vocab_size, (rows, m.seq_len + 1), generator=gen),
                 "sample_index": index}
        train_step(model, optimizer, batch, sampler.sample(step, index), step, 0, cfg, runtime, FlopModel.of(m))
        if step % 2 == 1 and step >= 4:  # the first two blocks: warm-up
            times[overlap].append(gather.busy_s - before)
            walls[overlap].append(time.perf_counter() - t0)
    runtime.finish_param_gather()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
        {"on": times[True], "off": times[False], "wall_on": walls[True], "wall_off": walls[False],
         "buckets": len(gather.ranges)}))
    runtime.close()


def measure(world: int, steps: int, bucket_elements: int) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank, args=(world, port, steps, bucket_elements, out_dir), nprocs=world, join=True)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("rank*.json"))]
    print(f"\nparcae-tiny fp32, gloo dp{world}, {ranks[0]['buckets']} all-gather buckets of {bucket_elements:,} "
          f"elements, {steps} steps each way (alternating)")
    print(f"{'rank':>5}{'gather, not overlapped':>24}{'exposed, overlapped':>21}{'hidden':>9}"
          f"{'step, not overlapped':>22}{'overlapped':>12}")
    hidden = []
    for rank, r in enumerate(ranks):
        off, on = statistics.median(r["off"]), statistics.median(r["on"])
        hidden.append(1 - on / off)
        print(f"{rank:>5}{off * 1e3:>21.2f} ms{on * 1e3:>18.2f} ms{hidden[-1]:>9.1%}"
              f"{statistics.median(r['wall_off']) * 1e3:>19.1f} ms{statistics.median(r['wall_on']) * 1e3:>9.1f} ms")
    print(f"fraction of the all-gather time hidden behind the forward (slowest rank): {min(hidden):.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--bucket-elements", type=int, default=262_144)
    ap.add_argument("--skip-measure", action="store_true")
    a = ap.parse_args()
    bucket_table([8, 16, 32, 64, 128])
    if not a.skip_measure:
        measure(a.dp, a.steps, a.bucket_elements)


if __name__ == "__main__":
    main()
