"""Sharded checkpoint saving: every rank calls :meth:`Checkpointer.save` at the same step.

Assumption: every rank sees `root` on one shared file system (NFS, Lustre, GPFS, or one machine's disk) with
POSIX rename/replace semantics, and ranks coordinate only through a gather to rank 0 and a scatter from it (one of
each per save, on the training thread; both can be made of one `all_gather_object`) and marker files under `root`;
this module never creates or uses a process group itself.

Protocol of one save (the training thread pays only for steps 1-3):

1. wait for the previous save (its SaveResult is kept for :meth:`Checkpointer.take_results`);
2. snapshot: copy every piece to CPU, so training may change its tensors at once (``stall_s``);
3. rank 0 gathers every rank's declarations, makes the plan (:mod:`checkpoints.plan`: chunk shape per array and
   which rank writes each chunk, replicas once) and scatters to each rank only its part of it (the arrays and chunks
   it writes) with rank 0's random token, or the reason the save is refused; no rank but 0 ever holds the others'
   declarations (at 128 ranks that is world x pieces objects, which an all-gather would hand every rank);
4. background thread: write this rank's part into ``step_XXXXXXXX.tmp-<token>`` (:mod:`checkpoints.writer`);
5. rank 0 only: commit once every rank recorded its part (:mod:`checkpoints.commit`).

A failed save is reported (``SaveResult.ok`` False, ``error`` naming the rank, file and array) and never becomes
``latest``. Ranks other than 0 only know their own part; :func:`wait_committed` tells them when rank 0 committed.
"""
from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from . import files
from .commit import commit, wait_committed  # noqa: F401  (wait_committed is part of this module's API)
from .pieces import Piece, validate_piece
from .plan import declare, make_plan
from .writer import WriteJob, run_write

RESERVED_METADATA = ("format", "schema_version", "step", "arrays")


@dataclass
class SaveResult:
    """The outcome of one save on this rank. On rank 0 `ok` means committed; on other ranks, own part written."""

    step: int
    path: Path
    ok: bool
    error: str | None = None
    stall_s: float = 0.0        # time the training thread spent in save() (snapshot + gather + plan)
    write_s: float = 0.0        # background time: writing, hashing, and on rank 0 the commit
    bytes_written: int = 0      # chunk bytes this rank wrote (replicas count once, on their writer)
    rank: int = 0
    token: str = ""


class Checkpointer:
    def __init__(self, root, *, rank: int = 0, world_size: int = 1, all_gather_object: Callable | None = None,
                 keep: int = 2, async_save: bool = True, commit_timeout_s: float = 600.0,
                 file_writer: Callable | None = None, gather_object: Callable | None = None,
                 scatter_object: Callable | None = None):
        """gather_object(obj) returns every rank's obj on rank 0 (None elsewhere) and scatter_object(objs) returns
        objs[rank] of the list rank 0 gave (e.g. torch.distributed.gather_object / scatter_object_list); without
        them both are made of all_gather_object (simpler, but it hands every rank everything)."""
        if world_size != 1 and all_gather_object is None and (gather_object is None or scatter_object is None):
            raise ValueError(f"world_size={world_size} needs gather_object and scatter_object, or all_gather_object "
                             "(e.g. wrappers of torch.distributed's); only a world of 1 can do without")
        if keep < 1:
            raise ValueError(f"keep={keep}: keep at least the newest checkpoint (keep >= 1)")
        self.root = Path(root)
        self.rank, self.world_size, self.keep = rank, world_size, keep
        all_gather = all_gather_object or (lambda obj: [obj])
        self.gather_object = gather_object or (lambda obj: (lambda got: got if rank == 0 else None)(all_gather(obj)))
        self.scatter_object = scatter_object or (lambda objs: all_gather(objs)[0][rank])
        self.async_save, self.commit_timeout_s = async_save, commit_timeout_s
        self.file_writer = file_writer or files.write_file
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ckpt-rank{rank}")
        self._inflight: Future | None = None
        self._buffers = SnapshotBuffers()
        self._preparing: Future | None = None
        self._results: list[SaveResult] = []
        self._last: SaveResult | None = None
        self._lock = threading.Lock()
        self._parts_written = threading.Event()  # rank 0: every rank's part of the save in flight is on disk

    def save(self, step: int, pieces: list[Piece], metadata: dict, refuse: str | None = None) -> None:
        """Snapshot `pieces`, agree on the plan with the other ranks, and write in the background (or now, when
        async_save is False). Raises ValueError (on every rank alike) for declarations that cannot be stored, or
        when a rank gives a reason to `refuse` the save (e.g. its metadata failed the caller's check)."""
        self.wait()
        t0 = time.perf_counter()
        self._wait_prepared()
        local_error = refuse or _check_local(pieces, metadata if self.rank == 0 else {})
        plan, token = self._agree(pieces, local_error, os.urandom(8).hex())
        mine = self._mine(plan, pieces)  # replicas that another rank writes are not copied
        # a synchronous save writes before training goes on: CPU tensors are written in place, without a copy
        tensors = (self._buffers.snapshot(mine) if self.async_save else
                   {_key(p): p.tensor.detach().to("cpu").contiguous() for p in mine})
        meta = json.loads(json.dumps(metadata)) if self.rank == 0 else {}  # a copy: the caller may change it
        job = WriteJob(self.root, step, token, self.rank, self.world_size, plan, tensors,
                       meta, self.file_writer, self.commit_timeout_s)
        stall = time.perf_counter() - t0
        if self.async_save:
            self._parts_written.clear()  # only wait() sets it, on this thread, after the job is submitted
            self._inflight = self._pool.submit(self._run, job, stall)
        else:
            self._finish(self._run(job, stall))

    def _agree(self, pieces: list[Piece], local_error: str | None, token: str):
        """The gather and scatter of a save: every rank's declarations to rank 0, which plans; back to each rank its
        part of the plan (rank 0 keeps the whole, to lay the arrays out) and rank 0's token. (plan, token)."""
        gathered = self.gather_object({"decls": [] if local_error else declare(pieces), "error": local_error})
        replies = None
        if self.rank == 0:
            plan, error = None, "; ".join(f"rank {r}: {g['error']}" for r, g in enumerate(gathered) if g["error"])
            if not error:
                try:
                    plan = make_plan([g["decls"] for g in gathered])
                except ValueError as exc:
                    error = str(exc)
            replies = [{"error": error, "token": token, "plan": plan if r == 0 or plan is None else plan.part_of(r)}
                       for r in range(self.world_size)]
        reply = self.scatter_object(replies)
        if reply["error"]:
            raise ValueError("checkpoint save refused: " + reply["error"])
        return reply["plan"], reply["token"]

    def _mine(self, plan, pieces: list[Piece]) -> list[Piece]:
        """The pieces this rank writes under `plan` (a piece is one chunk-grid region)."""
        mine = set(plan.regions_of(self.rank))
        return [p for p in pieces if _key(p) in mine]

    def prepare(self, pieces: list[Piece], block: bool = False) -> None:
        """Allocate (and touch) the snapshot buffers of the pieces this rank will write, in the background, so that
        even the first save's stall is a plain memory copy. Collective (one gather, like save); optional (save
        allocates what is missing)."""
        self._wait_prepared()
        plan, _ = self._agree(pieces, _check_local(pieces, {}), "prepare")
        shapes = [(_key(p), tuple(p.tensor.shape), p.tensor.dtype, p.tensor.device.type == "cuda")
                  for p in self._mine(plan, pieces)]
        self._preparing = self._pool.submit(self._buffers.allocate, shapes)
        if block:
            self._wait_prepared()

    def _wait_prepared(self) -> None:
        fut, self._preparing = self._preparing, None
        if fut is not None:
            fut.result()

    def wait(self, all_written: Callable[[], None] | None = None) -> SaveResult | None:
        """Block until the in-flight save (if any) committed or failed; returns the newest save's result.

        all_written: a collective (e.g. a barrier over the ranks) that every rank calls, once its own part is
        written, when a save is in flight (saves are collective, so all ranks have one or none). Rank 0 calls it
        without waiting, and on its return knows every part is on disk: its commit, which lists the staging
        directory only once a second, looks at once instead of at its next poll."""
        fut, self._inflight = self._inflight, None
        if fut is None:
            return self._last
        if all_written is not None and self.world_size > 1:
            if self.rank != 0:
                self._finish(fut.result())  # this rank's part is written (or failed, which rank 0 reads at once)
            all_written()
            if self.rank != 0:
                return self._last
            self._parts_written.set()
        self._finish(fut.result())
        return self._last

    def take_results(self) -> list[SaveResult]:
        """Results of finished saves not taken yet (oldest first), so that a failure is never lost."""
        with self._lock:
            out, self._results = self._results, []
        return out

    def close(self) -> SaveResult | None:
        """Wait for the in-flight save, then stop the background thread."""
        result = self.wait()
        self._pool.shutdown(wait=True)
        return result

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _finish(self, result: SaveResult) -> None:
        with self._lock:
            self._results.append(result)
            self._last = result

    def _run(self, job: WriteJob, stall: float) -> SaveResult:
        t0 = time.perf_counter()
        final = self.root / files.step_dir_name(job.step)
        result = SaveResult(job.step, final, False, stall_s=stall, rank=self.rank, token=job.token)
        try:
            result.bytes_written = run_write(job)
            if self.rank == 0:
                commit(self.root, job.step, job.token, self.world_size, self.commit_timeout_s, self.keep,
                       self._parts_written if self.async_save and self.world_size > 1 else None)
            result.ok = True
        except Exception as exc:  # reported through the result; the training loop decides what to do
            result.error = f"rank {self.rank}: checkpoint of step {job.step} not committed: {exc}"
            result.path = job.tmp
        result.write_s = time.perf_counter() - t0
        return result


def _key(p: Piece) -> tuple:
    return p.name, tuple(int(o) for o in p.offsets)


class SnapshotBuffers:
    """Host buffers that hold the snapshot of every piece, kept from one save to the next.

    Copying into memory that is already mapped costs a memory copy (~0.1 s per GiB here); a fresh allocation per
    save costs 10-30x more in page faults, all of it on the training thread. The price is one host copy of this
    rank's state, held for the run (pinned memory for pieces on a GPU, so that their copy is a DMA)."""

    def __init__(self):
        self._bufs: dict[tuple, torch.Tensor] = {}

    def allocate(self, shapes) -> None:
        for key, shape, dtype, pinned in shapes:
            buf = self._bufs.get(key)
            if buf is None or tuple(buf.shape) != shape or buf.dtype != dtype:
                self._bufs[key] = torch.zeros(shape, dtype=dtype, pin_memory=pinned and torch.cuda.is_available())

    def snapshot(self, pieces: list[Piece]) -> dict[tuple, torch.Tensor]:
        """Copy every piece into its buffer; returns {(name, offsets): buffer}."""
        self.allocate([(_key(p), tuple(p.tensor.shape), p.tensor.dtype, p.tensor.device.type == "cuda")
                       for p in pieces])
        out = {}
        for p in pieces:
            buf = self._bufs[_key(p)]
            buf.copy_(p.tensor.detach(), non_blocking=p.tensor.device.type == "cuda")
            out[_key(p)] = buf
        if any(p.tensor.device.type == "cuda" for p in pieces):
            torch.cuda.synchronize()
        return out


def _check_local(pieces: list[Piece], metadata: dict) -> str | None:
    """What is wrong with this rank's input (None if nothing), found before the gather so every rank can stop."""
    try:
        for p in pieces:
            validate_piece(p)
        clash = sorted(set(metadata) & set(RESERVED_METADATA))
        if clash:
            raise ValueError(f"metadata keys {clash} are reserved for the checkpoint itself; rename them")
        json.dumps(metadata)
    except (ValueError, TypeError) as exc:
        return str(exc)
    return None
