"""Run a function on N local processes with gloo (torch.multiprocessing), for the multi-process pipeline tests.

The function is called as fn(rank, world_size, *args) with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set, so
`pipeline.layout.init_layout` finds a torchrun-like environment; torch.distributed is torn down afterwards. An
exception on any rank fails the parent with that rank's traceback. Results travel through files (torch.save).
"""
from __future__ import annotations

import os
import socket

import torch
import torch.multiprocessing as mp

from pipeline.layout import destroy_layout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world_size: int, port: int, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        fn(rank, world_size, *args)
    finally:
        destroy_layout(barrier=False)  # frees the groups fn left behind while Python is alive (no SIGABRT at exit)


def spawn(fn, world_size: int, *args) -> None:
    """Run fn on world_size processes and wait for all of them."""
    mp.spawn(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size, join=True)
