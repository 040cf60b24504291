"""Resume I/O under data parallelism (gloo, one CPU process per rank): the bytes each rank reads from a checkpoint
while resuming, when every rank reads everything it loads (before) and when the state the data-parallel replicas
hold alike is read once per data-parallel group (after, megaloop.train.resume_io), beside the goal.

A small model (parcae-tiny, fp32) takes one optimizer step and is saved at the given layout, then resumed twice in
fresh model and optimizer objects through RunCheckpoints.restore, as a training job resumes (each rank verifies its
share of the files, then loads): with share_reads=False (the old path) and with the default. Per rank it prints what
the checkpoint reader counted: bytes checksummed by the verification, and chunk-file bytes of the parameters and of
the optimizer state read by the load; each is checked against a separate count (the bytes zarr's store fetched, the
bytes checksummed), and the two resumes' parameters and optimizer state must be identical bit for bit.

The goal per rank: its share of one verification pass (as before), the parameters once per data-parallel group
(its tensor-parallel shard of them, over dp) and its own optimizer shards (the optimizer state it holds: its ZeRO-1
rows of the AdamW moments and the Muon matrices it owns); under parallel.zero_stage=0 the optimizer state is
replicated too, and its goal is once per group like the parameters. A rank's ZeRO-1 rows are read in whole chunks,
so it reads up to one chunk per parameter at each end of its range beyond its own rows (--block-kib sizes them).

    python benchmarks/resume_io.py [--dp 4] [--tp 1] [--zero-stage 1] [--config configs/parcae-tiny.yaml]
                                   [--set model.vocab_size=8192 ...] [--block-kib 64]

Exit status 1 when a check fails. About a minute on 2 cores at dp 4.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CPU = torch.device("cpu")


class LoaderPosition:
    """The data source's part in a restore: the loader position the checkpoint records (this benchmark has no
    data)."""

    def __init__(self):
        self.state = None

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state)


def job_config(config: str, world: int, run_dir: str, tp: int, zero_stage: int, overrides: list[str]):
    from megaloop.config import load_config

    return load_config(config, ["train.precision=fp32", f"parallel.tp={tp}", f"parallel.dp={world // tp}",
                                f"parallel.zero_stage={zero_stage}", "data.global_batch_size=16",
                                "data.micro_batch_size=2", f"train.out_dir={run_dir}", "train.progress=false",
                                *overrides], world_size=world)


def build(cfg, init: bool = True):
    from megaloop.train.loop import build_model_and_optimizer
    from megaloop.train.runtime import make_runtime

    runtime = make_runtime(cfg, CPU)
    model, optimizer = build_model_and_optimizer(cfg, runtime, CPU, init=init)
    return runtime, model, optimizer


def take_step(runtime, model, optimizer) -> None:
    """One optimizer step on the same pseudo-random gradients on every rank, so that the replicas of a parameter
    (data-parallel, and tensor-parallel for one held whole) stay identical under every ZeRO stage."""
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        g = torch.randn(p.shape, generator=gen, dtype=p.dtype) * 1e-3
        p.grad = g if p.grad is None else p.grad.copy_(g)
    optimizer.step(0)
    runtime.finish_param_gather()


def state_of(runtime, model, optimizer) -> list:
    """(array, offsets, tensor) of every piece of state this rank holds (parameters and optimizer state), and the
    optimizer's counters."""
    from megaloop.train.checkpointing import state_pieces

    pieces, _ = state_pieces(model, optimizer, runtime)
    return [(p.name, tuple(p.offsets), p.tensor.detach().clone()) for p in pieces] + [
        ("iteration", (), optimizer.iteration), ("num_skipped", (), optimizer.num_skipped)]


def save(cfg, runtime, model, optimizer) -> None:
    """Step 1 as a training job saves it (the metadata a restore needs)."""
    from checkpoints.save import Checkpointer
    from megaloop.optim.combined import merge_scalars
    from megaloop.train.checkpointing import METADATA_VERSION, checkpoint_root, state_pieces

    pieces, scalars = state_pieces(model, optimizer, runtime)
    per_rank = runtime.gather_object(scalars)
    meta = {"megaloop_checkpoint": METADATA_VERSION, "config": cfg.to_dict(), "tokens": 0,
            "layout": runtime.describe_layout(), "loader": {"step": 1},
            "optimizer": merge_scalars(per_rank) if per_rank else scalars, "schedule_steps": cfg.train.steps}
    ckpt = Checkpointer(checkpoint_root(cfg), rank=runtime.rank, world_size=runtime.world_size, keep=1,
                        async_save=False, gather_object=runtime.gather_object, scatter_object=runtime.scatter_object)
    ckpt.save(1, pieces, meta)
    ckpt.close()
    runtime.barrier()


def checkpoint_sizes(cfg) -> dict:
    """The saved checkpoint's array sizes (global, from its metadata) and the sizes of its files on disk (those a
    verification checksums: all but COMMIT and manifest.json)."""
    from checkpoints.load import CheckpointReader
    from megaloop.train.checkpointing import checkpoint_root

    path = checkpoint_root(cfg) / "step_00000001"
    files = {p.relative_to(path).as_posix(): p.stat().st_size for p in path.rglob("*")
             if p.is_file() and p.name not in ("COMMIT", "manifest.json")}
    return {"array_bytes": {n: a.nbytes for n, a in CheckpointReader(path).arrays.items()}, "file_bytes": files}


def resume(cfg, share: bool) -> dict:
    """Restore the checkpoint into a fresh model and optimizer: what this rank read (as its reader counted it, and as
    counted separately), the resume's figures of every rank (RunCheckpoints.resume_io) and the state loaded."""
    import checkpoints.load
    from benchmarks.checkpoint_bytes import Counter
    from megaloop.train.checkpointing import RunCheckpoints

    runtime, model, optimizer = build(cfg, init=False)
    made = []

    class Kept(checkpoints.load.CheckpointReader):
        def __init__(self, path):
            super().__init__(path)
            made.append(self)

    ckpt = RunCheckpoints(cfg, runtime)
    original, checkpoints.load.CheckpointReader = checkpoints.load.CheckpointReader, Kept
    counter = Counter().install()
    try:
        start = ckpt.restore(model, optimizer, LoaderPosition(), share_reads=share)
    finally:
        counter.uninstall()
        checkpoints.load.CheckpointReader = original
    reader = made[-1]
    return {"start": start, "io": ckpt.resume_io, "by_array": dict(reader.bytes_by_array),
            "verified": reader.bytes_verified, "zarr_bytes": counter.chunk_reads, "checksummed": counter.verified,
            "state": state_of(runtime, model, optimizer)}


def measure(rank: int, world: int, config: str, tp: int, zero_stage: int, overrides: list, block_kib: int,
            root: str, out: str) -> None:
    """One rank of the benchmark (see the module docstring); rank 0 saves every rank's figures to `out`."""
    import pipeline.state_regions as regions
    from benchmarks.checkpoint_bytes import held_bytes

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    regions.BLOCK_BYTES = block_kib << 10  # the ZeRO-1 moment chunks, sized for a small model (see --block-kib)
    cfg = job_config(config, world, str(Path(root) / "run"), tp, zero_stage, overrides)
    runtime, model, optimizer = build(cfg)
    take_step(runtime, model, optimizer)
    save(cfg, runtime, model, optimizer)
    held = held_bytes(model, optimizer)
    figures = {"rank": rank, "tp_rank": runtime.tp_rank, "dp_rank": runtime.dp_rank, "dp": runtime.dp_size,
               "zero_stage": zero_stage, "saved": state_of(runtime, model, optimizer),
               "held_optim": held["moments"] + held["muon"],
               "param_bytes": {f"model/{n}": p.numel() * p.element_size() for n, p in model.named_parameters()}}
    figures.update(checkpoint_sizes(cfg))
    for label, share in (("before", False), ("after", True)):
        figures[label] = resume(cfg, share)
    everyone = runtime.all_gather_object(figures)
    if rank == 0:
        torch.save(everyone, out)
    runtime.close()


def run(world: int, tp: int = 1, zero_stage: int = 1, config: str | None = None, overrides: list[str] = (),
        block_kib: int = 64) -> list:
    """Spawn `world` ranks running `measure`; every rank's figures, in rank order."""
    from tests.pipeline.spawn import free_port

    base = Path(tempfile.mkdtemp(prefix="resume-io-"))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:
        mp.spawn(measure, args=(world, config or str(REPO / "configs" / "parcae-tiny.yaml"), tp, zero_stage,
                                list(overrides), block_kib, str(base), str(base / "out.pt")), nprocs=world,
                 join=True)
        return torch.load(base / "out.pt", weights_only=False)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def same_state(a: list, b: list) -> bool:
    """Whether two state_of lists hold the same pieces, bit for bit."""
    def equal(x, y):
        return torch.equal(x, y) if torch.is_tensor(x) and torch.is_tensor(y) else x == y

    return len(a) == len(b) and all(na == nb and oa == ob and equal(ta, tb)
                                    for (na, oa, ta), (nb, ob, tb) in zip(a, b))


def split(by_array: dict) -> tuple[int, int]:
    """(parameter bytes, optimizer-state bytes) of a reader's per-array counts."""
    params = sum(n for name, n in by_array.items() if name.startswith("model/"))
    return params, sum(by_array.values()) - params


def goal(f: dict) -> int:
    """This rank's goal: its verification share, plus the replicated state over the data-parallel group (the
    parameters, as every rank read them before; under ZeRO stage 0 the optimizer state too), plus its own optimizer
    shards (the optimizer state it holds)."""
    params, _ = split(f["before"]["by_array"])
    own = f["held_optim"] // f["dp"] if f["zero_stage"] == 0 else f["held_optim"]
    return f["after"]["verified"] + params // f["dp"] + own


def problems(figures: list) -> list[str]:
    """What the benchmark checks on every rank: identical state on both paths, and the reader's counts equal to the
    separate counts."""
    found = []
    for f in figures:
        for label in ("before", "after"):
            r = f[label]
            if sum(r["by_array"].values()) != r["zarr_bytes"] or r["verified"] != r["checksummed"]:
                found.append(f"rank {f['rank']} {label}: the reader counted {sum(r['by_array'].values())} read, "
                             f"{r['verified']} verified; zarr fetched {r['zarr_bytes']}, {r['checksummed']} "
                             "checksummed")
        if not same_state(f["before"]["state"], f["after"]["state"]):
            found.append(f"rank {f['rank']}: the state loaded differs between the two paths")
        if not same_state(f["saved"], f["after"]["state"]):
            found.append(f"rank {f['rank']}: the state loaded differs from the state saved")
    return found


COLUMNS = ("verify", "before params", "before optim", "before total", "after params", "after optim", "after total",
           "goal total")


def row_of(f: dict) -> dict:
    """One rank's figures in COLUMNS order (totals: verification + load)."""
    (bp, bo), (ap, ao) = split(f["before"]["by_array"]), split(f["after"]["by_array"])
    bv, av = f["before"]["verified"], f["after"]["verified"]
    return dict(zip(COLUMNS, (av, bp, bo, bv + bp + bo, ap, ao, av + ap + ao, goal(f))))


def mib(n: float) -> str:
    return f"{n / 2 ** 20:13.3f}"


def report(figures: list) -> None:
    f0 = figures[0]
    world, dp = len(figures), f0["dp"]
    print(f"resume I/O at tp{world // dp} x dp{dp}, ZeRO stage {f0['zero_stage']}: MiB read per rank (verify: its "
          "share of one checksum pass; params, optim: chunk files the load read; total: verify + load)")
    print("  rank tp dp" + "".join(f"{c:>14}" for c in COLUMNS))
    rows = [row_of(f) for f in figures]
    for f, row in zip(figures, rows):
        print(f"  {f['rank']:4d} {f['tp_rank']:2d} {f['dp_rank']:2d} " + " ".join(mib(row[c]) for c in COLUMNS))
    print("   all       " + " ".join(mib(sum(r[c] for r in rows)) for c in COLUMNS))
    print(f"  restore's line (after): ...; {f0['after']['io'].describe()}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dp", type=int, default=4, help="data-parallel ranks (default 4)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1); tp x dp processes run")
    ap.add_argument("--zero-stage", type=int, default=1, choices=(0, 1), help="parallel.zero_stage (default 1)")
    ap.add_argument("--config", default=str(REPO / "configs" / "parcae-tiny.yaml"))
    ap.add_argument("--set", nargs="*", default=["model.vocab_size=8192"], help="config overrides")
    ap.add_argument("--block-kib", type=int, default=64,
                    help="target KiB of a ZeRO-1 moment chunk (default 64: the trainer's 4 MiB would make each of\n"
                         "the tiny model's moments one chunk, which every rank whose rows touch it reads whole)")
    args = ap.parse_args()
    if args.dp < 1 or args.tp < 1:
        ap.error(f"--dp {args.dp} --tp {args.tp}: give positive sizes")
    figures = run(args.dp * args.tp, args.tp, args.zero_stage, args.config, args.set, args.block_kib)
    report(figures)
    found = problems(figures)
    for line in found:
        print(f"  FAIL {line}")
    print("checks PASS: identical state on both paths; the reader's counts equal zarr's fetches and the checksummed "
          "bytes" if not found else f"{len(found)} checks FAILED")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
