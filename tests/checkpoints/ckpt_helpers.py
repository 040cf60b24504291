"""Shared helpers of the checkpoint tests: a gather for ranks simulated by threads, grid pieces, fast writers."""
from __future__ import annotations

import threading
from pathlib import Path

import torch

from checkpoints import Piece


def fast_write(path: Path, data) -> None:
    """A chunk writer without fsync: the tests check the protocol, not the disk's durability."""
    with open(path, "wb") as f:
        f.write(data)


class CountingWriter:
    """Records which chunk files were written (and how many bytes), to prove replicas are written once."""

    def __init__(self):
        self.lock = threading.Lock()
        self.paths: list[str] = []
        self.nbytes = 0

    def __call__(self, path: Path, data) -> None:
        with self.lock:
            self.paths.append(str(path))
            self.nbytes += len(data)
        fast_write(path, data)


class ThreadGather:
    """all_gather_object for `world` ranks that are threads of this process (a barrier-based exchange)."""

    def __init__(self, world: int):
        self.world = world
        self.slots = [None] * world
        self.barrier = threading.Barrier(world, timeout=30)  # a rank that never gathers fails the others

    def for_rank(self, rank: int):
        def gather(obj):
            self.slots[rank] = obj
            self.barrier.wait()
            out = list(self.slots)
            self.barrier.wait()
            return out
        return gather


def run_ranks(world: int, fn, timeout: float = 120.0) -> list:
    """Run fn(rank, gather) on `world` threads; returns each rank's return value or the exception it raised."""
    gather = ThreadGather(world)
    out: list = [None] * world

    def body(rank):
        try:
            out[rank] = fn(rank, gather.for_rank(rank))
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out[rank] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a simulated rank hung"
    return out


def grid_pieces(name: str, full: torch.Tensor, grid: tuple[int, ...]) -> list[Piece]:
    """`full` cut into a regular grid of equal blocks (grid = blocks per dimension), one Piece per block."""
    block = [s // g for s, g in zip(full.shape, grid)]
    pieces = []
    for idx in torch.cartesian_prod(*[torch.arange(g) for g in grid]).reshape(-1, len(grid)).tolist():
        offsets = tuple(i * b for i, b in zip(idx, block))
        region = full[tuple(slice(o, o + b) for o, b in zip(offsets, block))]
        pieces.append(Piece(name, tuple(full.shape), offsets, region))
    return pieces


def bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of a tensor, so that equality is bit-exact (NaN, -0.0 and bf16 included)."""
    view = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
            torch.float16: torch.int16}.get(t.dtype)
    return t.view(view) if view is not None else t
