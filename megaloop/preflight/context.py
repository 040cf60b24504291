"""What every path of one preflight run shares: this rank's place, device and precision, the hosts of all ranks
(which groups cross nodes), the working folder and the shards, and the fault a test may inject."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

FAULT_ENV = "MEGALOOP_PREFLIGHT_FAULT"  # path names (comma list): their runs are perturbed, to show they can FAIL
CPU_TOL = 1e-12  # fp64 on CPU: a layout equals one process to rounding
GPU_LOSS_TOL = 2e-2  # bf16 on GPU: relative loss error after a few steps
GPU_PARAM_TOL = 5e-2  # bf16 on GPU: per-array max |a - b| / max |b|


@dataclass
class Context:
    rank: int
    world: int
    device: torch.device
    work_dir: Path
    hosts: list[str] = field(default_factory=list)
    shards: Path | None = None
    min_bw_fraction: float = 0.0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def precision(self) -> str:
        return "bf16" if self.on_gpu else "fp64"

    @property
    def compared_arrays(self) -> str:
        """The checkpoint arrays runs are compared on: all of them in fp64 on CPU; the parameters in bf16 on GPU
        (optimizer moments of near-zero gradients, e.g. AdamW's exp_avg_sq, differ relatively more than bf16's
        tolerance says anything about)."""
        return "model/" if self.on_gpu else ""

    @property
    def loss_tol(self) -> float:
        return GPU_LOSS_TOL if self.on_gpu else CPU_TOL

    @property
    def param_tol(self) -> float:
        return GPU_PARAM_TOL if self.on_gpu else CPU_TOL

    def faulty(self, path: str) -> bool:
        return path in os.environ.get(FAULT_ENV, "").split(",")

    def spans_nodes(self, ranks) -> bool:
        return len({self.hosts[r] for r in ranks}) > 1

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()


def world_hosts() -> list[str]:
    """Every rank's host name, in rank order."""
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    return hosts
