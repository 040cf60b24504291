"""Host-built tensors (index orders, masks, token rows) moved to the compute device without making the host wait,
and device results (a step's statistics) brought back the same way (`HostCopy`).

A copy from pageable host memory to a CUDA device is synchronous: the host stalls until the device stream has
caught up. From page-locked (pinned) memory with non_blocking=True it is queued on the stream like a kernel, and the
CUDA caching host allocator keeps the pinned block alive until the copy has run. `to_device` pins when the target
is a CUDA device (`pins`) and always asks for a non-blocking copy; on the CPU the tensor is returned as it is.
"""
from __future__ import annotations

import numpy as np
import torch


def pins(device: torch.device | str) -> bool:
    """Whether host tensors bound for `device` are pinned first (a CUDA device: pinning needs the CUDA driver)."""
    return torch.device(device).type == "cuda"


def to_device(x: np.ndarray | torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`x` (a numpy array or a host tensor) on `device`: pinned and copied with non_blocking=True where `pins`."""
    t = torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x
    if t.device.type == "cpu" and pins(device) and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


class HostCopy:
    """A device tensor's values on their way to the host without making it wait. On a CUDA device: a non-blocking
    copy into pinned memory and an event recorded after it on the current stream; `tolist()` waits for that event
    only, which has completed already when a later read (e.g. the optimizer's clip decision) synchronised the
    stream past it. Elsewhere the tensor itself, read as it is."""

    def __init__(self, t: torch.Tensor):
        t = t.detach()
        self.done = None
        if pins(t.device):
            self.host = torch.empty(t.shape, dtype=t.dtype).pin_memory()
            self.host.copy_(t, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:
            self.host = t

    def tolist(self) -> list:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()
