"""Checkpoint bytes per rank under data parallelism (gloo, one process per rank): what each rank receives from the
others while saving, and what it reads from the checkpoint while resuming, against what it holds.

- gathered per save: bytes this rank receives in collectives from building its pieces to the end of the save's
  agreement (tensor all-gathers, point-to-point receives, pickled objects of object collectives);
- read on resume: bytes of chunk files zarr fetches (the store's reads) while this rank loads its parameters and
  optimizer state as the trainer does, and bytes checksummed while verifying its share of the arrays;
- held: this rank's parameters (its tp/pp shard), its ZeRO-1 share of the AdamW moments and its Muon state; the
  bound is held + (all AdamW moments) / dp.

    python benchmarks/checkpoint_bytes.py [--dp 4] [--config configs/parcae-tiny.yaml] [--block-kib 64]
                                          [--before DIR]

--before DIR measures the same way with the code of another checkout (e.g. `git worktree add DIR 4eb6bb4`) and
prints both side by side. A loaded state equal to the saved one bit for bit is asserted on every rank.
"""
from __future__ import annotations

import argparse
import os
import pickle
import shutil
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Counter:
    """Bytes received in collectives and read from checkpoint files by this process, while installed."""

    def __init__(self):
        self.received = self.chunk_reads = self.verified = 0
        self._undo = []

    def _wrap(self, owner, name, after):
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            result = original(*args, **kwargs)
            after(result, *args, **kwargs)
            return result

        setattr(owner, name, wrapped)
        self._undo.append((owner, name, original))

    def install(self):
        import zarr.storage

        from checkpoints import files

        nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
        objects = lambda objs: sum(len(pickle.dumps(o)) for o in objs or [] if o is not None)  # noqa: E731

        def add(n):
            self.received += n

        self._wrap(dist, "all_gather_into_tensor", lambda r, out, *a, **k: add(nbytes(out)))
        self._wrap(dist, "all_gather", lambda r, outs, *a, **k: add(sum(nbytes(t) for t in outs)))
        if hasattr(dist, "all_gather_single"):
            self._wrap(dist, "all_gather_single", lambda r, out, *a, **k: add(nbytes(out)))
        self._wrap(dist, "all_gather_object", lambda r, outs, *a, **k: add(objects(outs)))
        self._wrap(dist, "gather_object", lambda r, obj, outs=None, *a, **k: add(objects(outs)))
        self._wrap(dist, "scatter_object_list", lambda r, outs, *a, **k: add(objects(outs)))
        self._wrap(dist, "batch_isend_irecv", lambda r, ops: add(sum(nbytes(op.tensor) for op in ops
                                                                      if op.op is dist.irecv)))
        store_get = zarr.storage.LocalStore.get

        async def get(store, key, *args, **kwargs):
            buf = await store_get(store, key, *args, **kwargs)
            if buf is not None and not key.endswith("zarr.json"):  # chunk files only, not metadata
                self.chunk_reads += len(buf)
            return buf

        zarr.storage.LocalStore.get = get
        self._undo.append((zarr.storage.LocalStore, "get", store_get))
        self._wrap(files, "file_digest", lambda r, path: setattr(self, "verified", self.verified + r[0]))
        return self

    def uninstall(self):
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo = []


def build(config: str, dp: int, overrides: list[str]):
    from megaloop.config import load_config
    from megaloop.train.loop import build_model_and_optimizer
    from megaloop.train.runtime import make_runtime

    cfg = load_config(config, ["train.precision=fp32", f"parallel.dp={dp}", "data.global_batch_size=16",
                               "data.micro_batch_size=2", *overrides], world_size=dp)
    runtime = make_runtime(cfg, torch.device("cpu"))
    model, optimizer = build_model_and_optimizer(cfg, runtime, torch.device("cpu"))
    return runtime, model, optimizer


def adamw_state(optimizer) -> list[torch.Tensor]:
    inner = getattr(optimizer.adamw, "inner", optimizer.adamw)
    return [t for st in inner.state.values() for k, t in sorted(st.items()) if k != "step"]


def held_bytes(model, optimizer) -> dict:
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    muon = getattr(optimizer.muon, "owned_state", None)
    muon_ts = [t for st in (muon or {}).values() for t in st.values()] if muon is not None else []
    return {"params": nbytes(p for p in model.parameters()), "moments": nbytes(adamw_state(optimizer)),
            "muon": nbytes(muon_ts)}


def measure(rank: int, dp: int, config: str, root: str, overrides: list, block_kib: int, out: str, code: str) -> None:
    sys.path.insert(0, code)  # before anything of the repository is imported here
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(dp), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        import pipeline.state_regions as regions

        regions.BLOCK_BYTES = block_kib << 10  # smaller moment chunks for a small model (after: the owners' blocks)
    except (ImportError, AttributeError):
        pass
    from checkpoints.load import CheckpointReader
    from checkpoints.save import Checkpointer
    from megaloop.optim.combined import join_names, load_sharded_state, merge_scalars, parameter_names
    from megaloop.train.checkpointing import load_model, make_reader_fn, state_pieces, verify_share

    runtime, model, optimizer = build(config, dp, overrides)
    gen = torch.Generator().manual_seed(rank)
    for p in model.parameters():
        g = torch.randn(p.shape, generator=gen, dtype=p.dtype) * 1e-3
        p.grad = g if p.grad is None else p.grad.copy_(g)
    optimizer.step(0)
    # the parameter all-gather may still run under the next forward; a --before checkout may predate it (and the
    # runtime's gather_object below), hence the lookups instead of the TrainerRuntime protocol's guarantee
    if hasattr(runtime, "finish_param_gather"):
        runtime.finish_param_gather()
    held = held_bytes(model, optimizer)
    moments_total = sum(runtime.all_gather_object(held["moments"]))
    saved_params = [p.detach().clone() for p in model.parameters()]
    saved_moments = [t.clone() for t in adamw_state(optimizer)]

    central = hasattr(runtime, "gather_object")
    kwargs = ({"gather_object": runtime.gather_object, "scatter_object": runtime.scatter_object} if central
              else {"all_gather_object": runtime.all_gather_object})
    ckpt = Checkpointer(root, rank=rank, world_size=dp, keep=1, async_save=False, **kwargs)
    runtime.barrier()
    counter = Counter().install()
    pieces, scalars = state_pieces(model, optimizer, runtime)
    per_rank = runtime.gather_object(scalars) if central else runtime.all_gather_object(scalars)
    meta = {"optimizer": merge_scalars(per_rank) if per_rank else scalars}
    ckpt.save(1, pieces, meta)
    gathered = counter.received
    counter.uninstall()
    ckpt.close()
    runtime.barrier()

    _, model2, optimizer2 = build(config, dp, overrides)  # a fresh job resuming
    reader = CheckpointReader(Path(root) / "step_00000001")
    counter = Counter().install()
    sizes = {n: int(torch.Size(a.shape).numel()) for n, a in reader.arrays.items()}
    reader.verify(verify_share(sizes, rank, dp))
    read = make_reader_fn(reader, runtime)
    load_model(model2, read)
    held_names = join_names(runtime.all_gather_object(parameter_names(optimizer2)))
    load_sharded_state(optimizer2, read, reader.metadata["optimizer"], held_names)
    counter.uninstall()
    same = (all(torch.equal(a, b) for a, b in zip(saved_params, model2.parameters()))
            and all(torch.equal(a, b) for a, b in zip(saved_moments, adamw_state(optimizer2)))
            and len(saved_moments) == len(adamw_state(optimizer2)))
    figures = {"rank": rank, "held": held, "moments_total": moments_total, "gathered": gathered,
               "read": counter.chunk_reads, "verified": counter.verified, "bitwise": same}
    everyone = runtime.all_gather_object(figures)
    if rank == 0:
        torch.save(everyone, out)
    runtime.close()


def run(dp: int, config: str, overrides: list[str], block_kib: int, code: Path | None = None) -> list[dict]:
    """Spawn dp ranks running `measure` with the code of `code` (default: this checkout); every rank's figures."""
    base = Path(tempfile.mkdtemp(prefix="ckpt-bytes-"))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:
        mp.spawn(measure, args=(dp, config, str(base / "ckpt"), overrides, block_kib, str(base / "out.pt"),
                                str(code or REPO)), nprocs=dp, join=True)
        return torch.load(base / "out.pt")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def mib(n: float) -> str:
    return f"{n / 2**20:8.3f}"


def report(label: str, figures: list[dict]) -> None:
    dp = len(figures)
    print(f"\n{label}: dp{dp}, MiB per rank (bound = params + muon held + all AdamW moments / dp)")
    print("  rank   params  moments/dp    muon   gathered/save   read on resume   bound   verified   bitwise")
    for f in figures:
        h = f["held"]
        bound = h["params"] + h["muon"] + f["moments_total"] / dp
        print(f"  {f['rank']:4d} {mib(h['params'])} {mib(f['moments_total'] / dp)}   {mib(h['muon'])}   "
              f"{mib(f['gathered'])}        {mib(f['read'])}       {mib(bound)} {mib(f['verified'])}   "
              f"{f['bitwise']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--config", default=str(REPO / "configs" / "parcae-tiny.yaml"))
    ap.add_argument("--set", nargs="*", default=["model.vocab_size=8192"], help="config overrides")
    ap.add_argument("--block-kib", type=int, default=64, help="target KiB of one owner-written moment chunk")
    ap.add_argument("--before", type=Path, help="another checkout to measure the same way (e.g. commit 4eb6bb4)")
    args = ap.parse_args()
    if args.before is not None:
        report(f"before ({args.before})", run(args.dp, args.config, args.set, args.block_kib, args.before.resolve()))
    report("after (this checkout)", run(args.dp, args.config, args.set, args.block_kib))


if __name__ == "__main__":
    main()
