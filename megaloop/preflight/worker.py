"""One rank's preflight: join the world, make the data (rank 0), run the chosen paths in order (every rank runs
every path: they are collective), print a progress line per path and the summary (rank 0), exit FAILED_EXIT_CODE
when a path failed. A path that raises ends this rank (its launcher then ends the others): the error is printed in
one line naming the path."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

FAILED_EXIT_CODE = 3  # every path ran and at least one failed (1: an error stopped the preflight)


def path_functions() -> dict:
    from megaloop.preflight import paths_checkpoint, paths_comm, paths_muon, paths_train

    return {"tp2_dp": paths_train.tp2_dp, "pp2_dp": paths_train.pp2_dp,
            "pp2_1p3b_messages": paths_comm.ring_1p3b_messages, "zero1": paths_comm.zero1_collectives,
            "dist_muon": paths_muon.dist_muon, "checkpoint_dp": paths_checkpoint.checkpoint_dp}


PATHS = ("tp2_dp", "pp2_dp", "pp2_1p3b_messages", "zero1", "dist_muon", "checkpoint_dp")


def _work_dir(given: str | None, is_main: bool) -> tuple[Path, bool]:
    """The folder every rank writes under (given: it must be shared by the nodes), or a temporary one made by rank
    0 (one machine); (folder, made here)."""
    import torch.distributed as dist

    made = [None]
    if given is None and is_main:
        made = [tempfile.mkdtemp(prefix="megaloop-preflight-")]
    dist.broadcast_object_list(made, src=0)
    return (Path(made[0]), True) if given is None else (Path(given), False)


def run_worker(args) -> int:
    import torch

    from megaloop.preflight.context import Context, world_hosts
    from megaloop.preflight.data import make_shards
    from megaloop.preflight.report import as_json, progress_line, table
    from pipeline.layout import destroy_layout, init_layout

    layout = init_layout(device=args.device, timeout_s=args.timeout)
    if layout.world_size < 2 or layout.world_size % 2:
        raise ValueError(f"the preflight needs an even number of processes (>= 2), got {layout.world_size}")
    work, made = _work_dir(args.work_dir, layout.rank == 0)
    ctx = Context(layout.rank, layout.world_size, layout.device, work, world_hosts(),
                  min_bw_fraction=args.min_bw_fraction)
    say = (lambda text: print(text, flush=True)) if ctx.is_main else (lambda text: None)
    nodes = len(set(ctx.hosts))
    say(f"megaloop preflight: {ctx.world} processes on {nodes} node(s), {layout.backend} on "
        f"{torch.cuda.get_device_name(ctx.device) if ctx.on_gpu else 'CPU'}, {ctx.precision} steps; paths: "
        f"{', '.join(args.only)}")
    say(f"megaloop preflight: process groups: {layout.group_stats.describe()}")
    if ctx.is_main:
        ctx.shards = make_shards(work / "data")
    ctx.barrier()
    ctx.shards = work / "data" / "shards"
    functions, results = path_functions(), []
    for index, name in enumerate(args.only, 1):
        ctx.barrier()
        say(f"[{index}/{len(args.only)}] {name}: running (a hang here ends at --timeout)")
        try:
            result = functions[name](ctx)
        except Exception as err:
            print(f"megaloop preflight: rank {ctx.rank}: path {name} stopped with {type(err).__name__}: "
                  f"{str(err).splitlines()[0] if str(err) else ''}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
        result.slow = bool(ctx.min_bw_fraction and result.expected_gbs and result.busbw_gbs is not None
                           and result.busbw_gbs < ctx.min_bw_fraction * result.expected_gbs)
        results.append(result)
        say(progress_line(index, len(args.only), result))
    say(table(results))
    if args.json:
        say(as_json(results, {"processes": ctx.world, "nodes": nodes, "backend": layout.backend,
                              "device": ctx.device.type}))
    ctx.barrier()
    if made and ctx.is_main and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    del layout
    destroy_layout()
    return 0 if all(r.status == "PASS" for r in results) else FAILED_EXIT_CODE


def launched() -> bool:
    """True in a process a launcher started (torchrun, srun, mpirun) as one of several."""
    from pipeline.layout import read_launch_env

    return "TORCHELASTIC_RUN_ID" in os.environ or read_launch_env().world_size > 1
