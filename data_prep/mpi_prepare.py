"""Shard preparation across MPI ranks (mpi4py).

Rank 0 makes the plan (file list, splits, encoder) and broadcasts it. The files to encode are cut into one
contiguous block per rank, balanced by bytes; each rank encodes its block (with its own local worker processes if
asked). Rank 0 streams its own block into the shard writer, then receives the other ranks' documents block by
block, in file order, so the output is the same bytes as a single-process run. Every rank first tells rank 0
whether its block succeeded, so a failing rank produces an error on rank 0 instead of a hang.

Run:  mpirun -n 4 python -m data_prep shards --input TEXT --tokenizer TOK --output OUT --seq-len 2048
"""
from __future__ import annotations

import os
from pathlib import Path

from .errors import DataPrepError
from .prepare import (ShardAssembler, ShardOptions, assemble_and_write, iter_encoded, plan_corpus,
                      prepare_output_dir, progress_bar, staging_dir)
from .tokenizer import load_tokenizer

MPI_ENV_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS", "HYDRA_CONTROL_FD")
TAG_STATUS, TAG_DOC = 11, 12


def launched_by_mpi() -> bool:
    """True when this process was started by mpirun/mpiexec (or srun with PMI)."""
    return any(name in os.environ for name in MPI_ENV_VARS)


def world_communicator():
    """MPI.COMM_WORLD, with a clear error when mpi4py is missing."""
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise DataPrepError("mpi4py is not installed",
                            "pip install mpi4py==4.1.2 (and an MPI library, e.g. apt-get install libopenmpi-dev "
                            "openmpi-bin), or run without --mpi") from err
    return MPI.COMM_WORLD


def split_blocks(sizes: list[int], parts: int) -> list[tuple[int, int]]:
    """Cut a list into `parts` contiguous [start, end) blocks of roughly equal total size."""
    total = sum(sizes)
    bounds, running, cut = [0], 0, 1
    for i, size in enumerate(sizes):
        running += size
        while cut < parts and running >= total * cut / parts:
            bounds.append(i + 1)
            cut += 1
    bounds += [len(sizes)] * (parts + 1 - len(bounds))
    return [(bounds[r], bounds[r + 1]) for r in range(parts)]


def _rank_blocks(plan, size: int) -> list[list[int]]:
    tasks = plan.tasks()
    blocks = split_blocks([plan.sources[i].size for i in tasks], size)
    return [tasks[start:end] for start, end in blocks]


def _encode_and_send(comm, plan, block, tokenizer_dir, options: ShardOptions) -> None:
    """Non-root ranks: encode the whole block, report success or the error, then send documents in order."""
    try:
        docs = list(iter_encoded(plan, block, tokenizer_dir, options.workers, options.max_invalid_fraction))
    except Exception as err:  # reported to rank 0, which raises it
        comm.send(("error", f"{type(err).__name__}: {err}"), dest=0, tag=TAG_STATUS)
        raise
    comm.send(("ok", len(docs)), dest=0, tag=TAG_STATUS)
    for doc in docs:
        comm.send(doc, dest=0, tag=TAG_DOC)


def _documents_at_root(comm, plan, blocks, tokenizer_dir, options: ShardOptions, tok):
    """Rank 0: its own block as it is encoded, then every other rank's block in rank order."""
    yield from iter_encoded(plan, blocks[0], tokenizer_dir, options.workers, options.max_invalid_fraction, tok)
    for rank in range(1, comm.Get_size()):
        status, detail = comm.recv(source=rank, tag=TAG_STATUS)
        if status != "ok":
            raise DataPrepError(f"MPI rank {rank} failed to encode its files: {detail}", "fix the cause and re-run")
        for _ in range(detail):
            yield comm.recv(source=rank, tag=TAG_DOC)


def _root_plan(input_dir, tokenizer_dir, output_dir, options: ShardOptions):
    """Rank 0's checks and plan; returns (plan, tokenizer)."""
    options.validate()
    tok = load_tokenizer(tokenizer_dir, encoder=options.encoder)
    plan = plan_corpus(input_dir, tok, options)
    prepare_output_dir(Path(output_dir), options.overwrite)   # shards are written to staging_dir(output_dir)
    return plan, tok


def prepare_shards_mpi(input_dir, tokenizer_dir, output_dir, options: ShardOptions, comm=None) -> dict | None:
    """prepare_shards over all ranks of `comm` (default COMM_WORLD): the manifest on rank 0, None elsewhere."""
    comm = comm or world_communicator()
    rank, size = comm.Get_rank(), comm.Get_size()
    plan = tok = None
    failure = None
    if rank == 0:
        try:
            plan, tok = _root_plan(input_dir, tokenizer_dir, output_dir, options)
        except Exception as err:
            failure = err
    plan = comm.bcast(plan if failure is None else None, root=0)
    if failure is not None:
        failure.collective = True   # every rank knows: exit cleanly, no MPI_Abort needed
        raise failure
    if plan is None:
        error = DataPrepError("rank 0 could not plan the job (its error is printed by rank 0)", "fix the cause")
        error.collective = True
        raise error
    blocks = _rank_blocks(plan, size)
    if rank != 0:
        _encode_and_send(comm, plan, blocks[rank], tokenizer_dir, options)
        return None
    assembler = ShardAssembler(plan, tok, options, staging_dir(Path(output_dir)))
    bar = progress_bar(sum(plan.sources[i].size for i in plan.tasks()), options.progress)
    documents = _documents_at_root(comm, plan, blocks, tokenizer_dir, options, tok)
    return assemble_and_write(assembler, documents, bar, Path(output_dir))
