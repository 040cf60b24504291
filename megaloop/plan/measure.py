"""Measuring what the planner predicts: the peak of live tensor bytes, from the CPU allocator's own records.

torch.profiler with profile_memory=True records every allocation and free of the c10 CPU allocator with its size;
their running sum is the bytes held by live tensors (what torch.cuda.max_memory_allocated reports on a GPU),
without the allocator's fragmentation or the process's other memory. Only allocations made inside the block
count, so build the model inside it to include parameters and optimizer state. `mark(name)` inside the block
splits it into phases: afterwards `phases` holds (name, live bytes at the mark, peak since the previous mark).
Frees made on threads the profiler does not follow (gloo's work threads) are missed, so with several processes the
running sum drifts upwards from step to step: measure one process, or compare with the resident set.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

_MARK_BASE = 7_654_321  # marks are allocations of _MARK_BASE + i bytes, sizes no tensor of the model has


@dataclass
class LivePeak:
    """After the block: peak and final live bytes allocated inside it, and the phases between marks."""

    peak: int = 0
    final: int = 0
    phases: list = field(default_factory=list)
    _names: list = field(default_factory=list)

    def mark(self, name: str) -> None:
        import torch

        self._names.append(name)
        torch.empty(_MARK_BASE + len(self._names) - 1, dtype=torch.uint8)


@contextlib.contextmanager
def live_tensor_peak():
    """with live_tensor_peak() as result: ...  ->  result.peak, result.final (bytes), result.phases."""
    from torch.profiler import ProfilerActivity, profile

    result = LivePeak()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield result
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = phase_peak = 0
    for e in events:
        size = e.nbytes()
        index = abs(size) - _MARK_BASE
        if 0 <= index < len(result._names):
            if size > 0:
                result.phases.append((result._names[index], live, phase_peak))
                phase_peak = live
            continue
        live += size
        result.peak = max(result.peak, live)
        phase_peak = max(phase_peak, live)
    result.phases.append(("end", live, phase_peak))
    result.final = live
