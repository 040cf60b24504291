"""Measuring what the planner predicts: the peak of live tensor bytes, from the CPU allocator's own records.

torch.profiler with profile_memory=True records every allocation and free of the c10 CPU allocator with its size;
their running sum is the bytes held by live tensors (what torch.cuda.max_memory_allocated reports on a GPU),
without the allocator's fragmentation or the process's other memory. Only allocations made inside the block
count, so build the model inside it to include parameters and optimizer state.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field


@dataclass
class LivePeak:
    """After the block: peak and final live bytes allocated inside it."""

    peak: int = 0
    final: int = 0
    events: int = 0
    marks: list = field(default_factory=list)


@contextlib.contextmanager
def live_tensor_peak():
    """with live_tensor_peak() as result: ...  ->  result.peak, result.final (bytes)."""
    from torch.profiler import ProfilerActivity, profile

    result = LivePeak()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield result
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    events.sort(key=lambda e: e.start_ns())
    live = 0
    for e in events:
        live += e.nbytes()
        result.peak = max(result.peak, live)
    result.final, result.events = live, len(events)
