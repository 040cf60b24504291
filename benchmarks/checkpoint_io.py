"""Checkpoint I/O of a parcae-140m-sized training state (fp32 parameters, Muon momentum and NorMuon second moments,
AdamW moments): megaloop's zarr checkpoints against torch.distributed.checkpoint (DCP), side by side in one run,
in one process and with dp2 (gloo; ZeRO-1 AdamW and distributed Muon, so each rank holds a different share):

- save: the whole protocol (snapshot, plan, write, checksums, commit) vs dcp.save of the same pieces;
- load: reading every region this rank holds vs dcp.load into tensors of the same shapes;
- async save: the training thread's stall (snapshot into host buffers allocated after the first step, as the
  trainer does, + the plan) vs the background write time.

    python benchmarks/checkpoint_io.py [--config configs/parcae-140m.yaml] [--worlds 1,2] [--dir DIR]

DCP is given exactly the pieces zarr writes (one key per region; replicas share a key, which DCP writes once), so the
two engines do the same work. Both write into the page cache of the same disk; the figures are wall-clock seconds
of the slowest rank, best of --repeats.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_state(config: str, world: int):
    """A trained-looking state: the model, one optimizer step on seeded random gradients (creates every state)."""
    from megaloop.config import load_config
    from megaloop.train.checkpointing import state_pieces
    from megaloop.train.loop import build_model_and_optimizer
    from megaloop.train.runtime import make_runtime

    cfg = load_config(config, ["train.precision=fp32", f"parallel.dp={world}", "data.global_batch_size=64",
                               "data.micro_batch_size=8"], world_size=world)
    runtime = make_runtime(cfg, torch.device("cpu"))
    model, optimizer = build_model_and_optimizer(cfg, runtime, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype) * 1e-3
    optimizer.step(0)
    pieces, _ = state_pieces(model, optimizer, runtime)
    return runtime, pieces


def slowest(runtime, seconds: float) -> float:
    return runtime.world_max(seconds)


def time_zarr(runtime, pieces, root: Path, async_save: bool) -> dict:
    from checkpoints.load import CheckpointReader
    from checkpoints.save import Checkpointer

    ckpt = Checkpointer(root, rank=runtime.rank, world_size=runtime.world_size,
                        all_gather_object=runtime.all_gather_object, keep=1, async_save=async_save)
    ckpt.prepare(pieces, block=True)  # as the trainer does after its first step
    runtime.barrier()
    t0 = time.perf_counter()
    ckpt.save(1, pieces, {"benchmark": True})
    stall = time.perf_counter() - t0
    result = ckpt.wait()
    runtime.barrier()
    total = time.perf_counter() - t0
    ckpt.close()
    assert result is not None and result.ok, result
    reader = CheckpointReader(root / "step_00000001")
    runtime.barrier()
    t0 = time.perf_counter()
    for p in pieces:
        reader.read(p.name, p.offsets, tuple(p.tensor.shape))
    load = time.perf_counter() - t0
    return {"save": slowest(runtime, total), "load": slowest(runtime, load), "stall": slowest(runtime, stall),
            "write": slowest(runtime, result.write_s), "bytes": runtime.world_max(result.bytes_written)}


def time_dcp(runtime, pieces, root: Path) -> dict:
    state = {f"{p.name}@{','.join(map(str, p.offsets))}": p.tensor.detach().clone() for p in pieces}
    runtime.barrier()
    t0 = time.perf_counter()
    dcp.save(state, checkpoint_id=str(root), no_dist=not dist.is_initialized())
    runtime.barrier()
    save = time.perf_counter() - t0
    target = {k: torch.empty_like(v) for k, v in state.items()}
    runtime.barrier()
    t0 = time.perf_counter()
    dcp.load(target, checkpoint_id=str(root), no_dist=not dist.is_initialized())
    load = time.perf_counter() - t0
    assert all(torch.equal(target[k], v) for k, v in state.items())
    return {"save": slowest(runtime, save), "load": slowest(runtime, load)}


def measure(rank: int, world: int, config: str, base: str, repeats: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    runtime, pieces = build_state(config, world)
    nbytes = sum(p.tensor.numel() * p.tensor.element_size() for p in pieces)
    best: dict = {}
    for i in range(repeats):
        for label, fn in (("zarr", lambda d: time_zarr(runtime, pieces, d, async_save=False)),
                          ("dcp", lambda d: time_dcp(runtime, pieces, d)),
                          ("async", lambda d: time_zarr(runtime, pieces, d, async_save=True))):
            d = Path(base) / f"{label}-{world}-{i}"
            figures = fn(d)
            best[label] = {k: min(v, best.get(label, {}).get(k, float("inf"))) for k, v in figures.items()}
            runtime.barrier()
            if runtime.is_main:
                shutil.rmtree(d, ignore_errors=True)
    held = runtime.all_gather_object(nbytes)
    if runtime.is_main:
        torch.save({"best": best, "held": held}, out)
    runtime.close()


def report(world: int, figures: dict) -> None:
    z, d, a = figures["best"]["zarr"], figures["best"]["dcp"], figures["best"]["async"]
    held = ", ".join(f"{b / 2**30:.2f}" for b in figures["held"])
    print(f"\n{world} process(es): state held per rank {held} GiB")
    print(f"  save: zarr {z['save']:.2f} s, DCP {d['save']:.2f} s, ratio zarr/DCP {z['save'] / d['save']:.2f}")
    print(f"  load: zarr {z['load']:.2f} s, DCP {d['load']:.2f} s, ratio zarr/DCP {z['load'] / d['load']:.2f}")
    print(f"  async save: training stall {a['stall']:.3f} s, background write {a['write']:.2f} s, stall / write "
          f"{a['stall'] / a['write']:.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "configs" / "parcae-140m.yaml"))
    ap.add_argument("--worlds", default="1,2", help="process counts to measure, comma-separated (default 1,2)")
    ap.add_argument("--repeats", type=int, default=2, help="best of this many rounds (default 2)")
    ap.add_argument("--dir", help="where to write the checkpoints (default: a temporary folder, removed after)")
    args = ap.parse_args()
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ckpt-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        for world in (int(w) for w in args.worlds.split(",")):
            out = base / f"figures-{world}.pt"
            mp.spawn(measure, args=(world, args.config, str(base), args.repeats, free_port(), str(out)), nprocs=world,
                     join=True)
            report(world, torch.load(out))
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
