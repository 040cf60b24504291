"""Run a function on N local processes with gloo (torch.multiprocessing), for the multi-process pipeline tests.

The function is called as fn(rank, world_size, *args) with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set, so
`pipeline.layout.init_layout` finds a torchrun-like environment; torch.distributed is torn down afterwards. An
exception on any rank fails the parent with that rank's traceback. Results travel through files (torch.save).

No worker outlives the test: when the parent stops waiting for any reason (a failing rank, pytest-timeout's
exception, Ctrl-C) the workers still running are killed before the exception goes on, and each worker asks the
kernel for SIGKILL when its parent dies (Linux), which covers a parent killed outright (pytest-timeout's thread
method ends pytest with os._exit).
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys

import torch
import torch.multiprocessing as mp

from pipeline.layout import destroy_layout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent exits (Linux prctl PR_SET_PDEATHSIG; elsewhere a
    no-op)."""
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)


def _entry(rank: int, fn, world_size: int, port: int, args: tuple, parent: int) -> None:
    die_with_parent()
    if os.getppid() != parent:  # the parent died before the request was made
        os._exit(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        fn(rank, world_size, *args)
    finally:
        destroy_layout(barrier=False)  # frees the groups fn left behind while Python is alive (no SIGABRT at exit)


def spawn(fn, world_size: int, *args) -> None:
    """Run fn on world_size processes and wait for all of them; none is left running when this returns or raises."""
    context = mp.start_processes(_entry, args=(fn, world_size, free_port(), args, os.getpid()), nprocs=world_size,
                                 join=False, start_method="spawn")
    try:
        while not context.join():
            pass
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()
