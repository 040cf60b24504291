"""Process groups at start-up: world-wide operations, communicators and creation time, before (one dist.new_group per
group of every kind and per ring channel, each a world-wide operation) and after (pipeline/groups.py: one per
partition of disjoint groups; on gloo the tp/dp/pp/embed groups still one each), measured on CPU with gloo, side
by side in one run, and the planner's formula (megaloop/plan/startup.py) for the GPU job's layouts on NCCL.

    python benchmarks/group_startup.py [--world 4] [--repeats 3]

Each layout runs in one set of --world processes (one thread each): the earlier creation and the current one
alternate --repeats times (groups are never destroyed in between, as torch keeps them to the end); the time is the
slowest rank's, the median over the repeats.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

LAYOUTS = {"pp2 x dp2": (2, 2), "pp4": (4, 1)}
GPU_LAYOUTS = ((8, 16), (4, 32), (1, 128))  # (pp, dp) on 128 GPUs, tp 1


def _before(rank: int, tp: int, dp: int, pp: int) -> tuple[int, int]:
    """The earlier creation: every group of every kind, then every pipeline's channels, one new_group each."""
    import torch.distributed as dist

    from pipeline.layout import group_ranks
    from pipeline.ring.channels import ring_pairs

    kinds, ops, mine = group_ranks(tp, dp, pp), 0, 0
    for kind, size in (("tp", tp), ("dp", dp), ("pp", pp), ("embed", min(pp, 2))):
        for ranks in kinds[kind] if size > 1 else []:
            dist.new_group(ranks)
            ops, mine = ops + 1, mine + (rank in ranks)
    for ranks in kinds["pp"]:
        for s, d in ring_pairs(pp):
            dist.new_group([ranks[s], ranks[d]])
            ops, mine = ops + 1, mine + (rank in (ranks[s], ranks[d]))
    return ops, mine


def _after(rank: int, tp: int, dp: int, pp: int) -> tuple[int, int]:
    from pipeline.layout import _create_groups, group_ranks
    from pipeline.ring.channels import ring_channels

    kinds = _create_groups(rank, tp, dp, pp)["group_stats"]
    channels = ring_channels(group_ranks(tp, dp, pp)["pp"], rank)
    ops = kinds.world_ops + channels.stats.world_ops
    mine = kinds.communicators + channels.stats.communicators
    channels.close()
    return ops, mine


def _rank(rank: int, world: int, pp: int, dp: int, repeats: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = {"before": [], "after": []}
    for _ in range(repeats):
        for name, make in (("before", _before), ("after", _after)):
            dist.barrier()
            t0 = time.perf_counter()
            ops, mine = make(rank, 1, dp, pp)
            result[name].append((time.perf_counter() - t0, ops, mine))
    dist.barrier()
    dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def measure(world: int, pp: int, dp: int, repeats: int) -> dict:
    import os

    import torch.multiprocessing as mp

    from tests.pipeline.spawn import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank, args=(world, pp, dp, repeats, out_dir), nprocs=world, join=True)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(out_dir).glob("rank*.json"))]
    out = {}
    for name in ("before", "after"):
        times = [max(r[name][k][0] for r in ranks) for k in range(repeats)]
        out[name] = (statistics.median(times), ranks[0][name][0][1], max(r[name][0][2] for r in ranks))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    from megaloop.plan.startup import startup_groups, startup_line

    print(f"gloo on CPU, {a.world} processes: world-wide operations / communicators on the busiest rank / creation "
          "time (slowest rank, median)")
    print(f"{'layout':<12}{'before':>24}{'after':>24}")
    for name, (pp, dp) in LAYOUTS.items():
        r = measure(a.world, pp, dp * a.world // (pp * dp), a.repeats)
        cells = [f"{ops} / {mine} / {t * 1e3:.1f} ms" for t, ops, mine in (r["before"], r["after"])]
        formula = startup_groups(1, dp * a.world // (pp * dp), pp, "gloo")
        print(f"{name:<12}{cells[0]:>24}{cells[1]:>24}   (formula: {formula.world_ops_before} -> {formula.world_ops})",
              flush=True)
    print("\nNCCL with the device bound (every new_group an ncclCommSplit of the world), 128 GPUs, tp 1:")
    for pp, dp in GPU_LAYOUTS:
        print(f"  pp {pp} x dp {dp}: {startup_line(1, dp, pp)}")


if __name__ == "__main__":
    main()
