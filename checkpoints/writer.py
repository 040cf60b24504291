"""One rank's part of a save, run on the background thread: create (rank 0), write own chunks, hash, record.

Rank 0 creates the zarr v3 group and array metadata in the staging directory ``step_XXXXXXXX.tmp-<token>``
(global shape, the plan's chunk shape, no compression: plain little-endian ``bytes`` codec, fill value 0,
attribute ``torch_dtype``) and ``metadata.json``, while every rank writes the chunk files the plan gives it (the
token in the directory's name keeps a killed earlier attempt's files apart, so nobody waits for anybody here). Chunk files are written directly in zarr's layout (``<array>/c/i/j``, the raw
little-endian C-order bytes of the block) through the ``file_writer`` hook, hashing the bytes as they go out.
Each rank ends by writing ``manifest.rankNNNNN.json`` (its files with size and checksum) or, if anything failed,
``failed.rankNNNNN.json`` with the error, both atomically.
"""
from __future__ import annotations

import json
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import zarr
from zarr.core.metadata.v3 import ArrayV3Metadata
from zarr.storage import LocalStore

from . import files
from .pieces import STORAGE_DTYPE, chunk_key, tensor_bytes
from .plan import SavePlan

WRITE_THREADS = 4  # chunk files written at once per rank


@dataclass
class WriteJob:
    """Everything the background thread needs; tensors are CPU snapshots keyed by (array name, offsets)."""

    root: Path
    step: int
    token: str
    rank: int
    world_size: int
    plan: SavePlan
    tensors: dict
    metadata: dict
    file_writer: Callable
    timeout_s: float

    @property
    def tmp(self) -> Path:
        return self.root / files.tmp_dir_name(self.step, self.token)


def run_write(job: WriteJob) -> int:
    """Write this rank's part and its partial manifest; returns the chunk bytes written. On error, records
    ``failed.rankNNNNN.json`` (and, on rank 0, ``ABORTED``) and re-raises."""
    try:
        # the staging directory's name carries this save's token, so no rank can meet a stale attempt there: the
        # others write their chunk files at once, while rank 0 creates the zarr metadata beside them
        with ThreadPoolExecutor(max_workers=1) as layout_thread:
            layout = layout_thread.submit(_create_layout, job) if job.rank == 0 else None
            chunks, nbytes = _write_chunks(job)
            recorded = layout.result() if layout is not None else {}
        recorded.update(chunks)
        files.atomic_write_json(job.tmp / files.manifest_part_name(job.rank), {
            "rank": job.rank, "token": job.token, "algorithm": files.HASH_ALGORITHM,
            "bytes_written": nbytes, "files": recorded})
        return nbytes
    except BaseException as exc:
        record_failure(job, exc)
        raise


def record_failure(job: WriteJob, exc: BaseException) -> None:
    """Best effort: leave the error where rank 0's commit (and a person) will find it."""
    try:
        job.tmp.mkdir(parents=True, exist_ok=True)
        files.atomic_write_json(job.tmp / files.failed_name(job.rank),
                                {"rank": job.rank, "token": job.token, "error": f"{type(exc).__name__}: {exc}"})
        if job.rank == 0:
            write_aborted(job.tmp, job.token, f"rank 0 failed: {exc}")
    except OSError:
        pass


def write_aborted(tmp: Path, token: str, reason: str) -> None:
    files.atomic_write_json(tmp / "ABORTED", {"token": token, "reason": reason})


def array_json(shape, chunks, dtype: str) -> dict:
    """The zarr v3 array metadata we write: no compression, plain little-endian bytes, fill 0, torch dtype."""
    return {"zarr_format": 3, "node_type": "array", "shape": list(shape), "data_type": STORAGE_DTYPE[dtype],
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunks)}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}}, "fill_value": 0,
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
            "attributes": {"torch_dtype": dtype}}


def _create_layout(job: WriteJob) -> dict:
    """Rank 0: staging dir, zarr group and arrays, metadata.json. Returns their manifest entries."""
    job.tmp.mkdir(parents=True, exist_ok=True)
    nodes = {a.name: ArrayV3Metadata.from_dict(array_json(a.shape, a.chunks, a.dtype))
             for a in job.plan.arrays.values()}
    list(zarr.create_hierarchy(store=LocalStore(job.tmp), nodes=nodes))  # parent groups are added by zarr
    # the root group lists its members itself: plain zarr then walks the checkpoint without listing the directory,
    # where metadata.json, manifest.json and COMMIT would each be warned about as "not a component of a hierarchy"
    with warnings.catch_warnings():  # zarr notes that consolidated metadata is outside the v3 spec; we know
        warnings.simplefilter("ignore", category=UserWarning)
        zarr.consolidate_metadata(LocalStore(job.tmp))
    meta = dict(job.metadata)
    meta.update(format=files.FORMAT, schema_version=files.SCHEMA_VERSION, step=job.step, arrays={
        a.name: {"shape": list(a.shape), "dtype": a.dtype, "chunks": list(a.chunks)}
        for a in job.plan.arrays.values()})
    files.write_file(job.tmp / "metadata.json", (json.dumps(meta, indent=1) + "\n").encode())
    recorded = {}
    for path in [job.tmp / "metadata.json", *sorted(job.tmp.rglob("zarr.json"))]:
        size, digest = files.file_digest(path)
        recorded[path.relative_to(job.tmp).as_posix()] = {"size": size, files.HASH_ALGORITHM: digest}
    files.fsync_dir(job.tmp)
    return recorded


def _write_chunks(job: WriteJob) -> tuple[dict, int]:
    """Write the chunk files the plan assigns to this rank, a few at a time (file writes, CRC-32 and fsync release
    the GIL, and parallel writes fill a parallel file system better); returns (manifest entries, bytes written)."""
    todo = [(name, offsets) for name, offsets in job.plan.regions_of(job.rank) if job.plan.arrays[name].nbytes]
    with ThreadPoolExecutor(max_workers=WRITE_THREADS) as pool:
        done = list(pool.map(lambda item: _write_chunk(job, *item), todo))
    return dict(done), sum(entry["size"] for _, entry in done)


def _write_chunk(job: WriteJob, name: str, offsets: tuple) -> tuple[str, dict]:
    a = job.plan.arrays[name]
    rel = f"{name}/{chunk_key(tuple(o // c for o, c in zip(offsets, a.chunks)))}"
    data = tensor_bytes(job.tensors[(name, offsets)])
    path = job.tmp / rel
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        job.file_writer(path, data)
        size = path.stat().st_size
    except OSError as exc:
        raise OSError(exc.errno, f"writing {rel} (array {name!r}) failed: {exc.strerror or exc}") from exc
    if size != len(data):
        raise OSError(f"writing {rel} (array {name!r}): {size} bytes on disk, {len(data)} expected (short write)")
    return rel, {"size": size, files.HASH_ALGORITHM: f"{files.hash_bytes(data):08x}"}
