"""GPU memory sizes and the headroom the planner leaves on them."""
from __future__ import annotations

from dataclasses import dataclass

GIB = 2 ** 30
CONTEXT_BYTES = 2 * GIB  # CUDA context, cuBLAS/cuDNN workspaces and NCCL buffers
FRAGMENTATION = 0.05  # the caching allocator's fragmentation and reserved-but-unused blocks


@dataclass(frozen=True)
class Gpu:
    name: str
    total_bytes: int  # as nvidia-smi reports the total

    @property
    def headroom_bytes(self) -> int:
        return CONTEXT_BYTES + int(FRAGMENTATION * self.total_bytes)

    @property
    def usable_bytes(self) -> int:
        return self.total_bytes - self.headroom_bytes


GPUS = {
    "h100": Gpu("H100 80GB", 81559 * 2 ** 20),
    "h200": Gpu("H200 141GB", 143771 * 2 ** 20),
    "a100": Gpu("A100 80GB", 81920 * 2 ** 20),
}


def gpu(name: str) -> Gpu:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU {name!r}: known {', '.join(GPUS)}") from None
