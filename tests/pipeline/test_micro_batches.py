"""The runtimes' shared micro-batch loop (pipeline/micro_batches.py) against the one-process reference of the ring
stage test (tests/pipeline/workers_ring.reference: LoopedLM.forward per micro-batch, loss times its scale,
backward), in float64 on parcae-tiny with 4 core blocks: five micro-batches of different per-sequence depths, one
with a given h_0. Losses and every gradient must be bit-identical (the same operations in the same order), the
runtime's overlap hook must come exactly once, right before the last backward, and the timer must get one forward
and one backward span per micro-batch."""
from __future__ import annotations

import pytest
import torch

from megaloop.train.runtime import SingleProcessRuntime
from tests.pipeline.workers_ring import build, reference, scales


class RecordingRuntime(SingleProcessRuntime):
    """The single-process runtime, recording its backward and overlap calls in order."""

    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.calls: list[str] = []

    def backward(self, loss):
        self.calls.append("backward")
        super().backward(loss)

    def overlap_next_backward(self):
        self.calls.append("overlap")


class CountingTimer:
    def __init__(self):
        self.marks, self.spans = 0, []

    def mark(self):
        self.marks += 1
        return self.marks

    def add(self, name, start, end):
        self.spans.append((name, start, end))


def test_loop_equals_the_one_process_reference():
    model, batches = build("parcae")
    ref_losses, ref_grads = reference("parcae")
    runtime, timer, factors = RecordingRuntime(), CountingTimer(), scales(batches)
    results = runtime.run_micro_batches(model, batches, factors, timer=timer)
    losses = torch.stack([r.loss * s for r, s in zip(results, factors)])
    grads = {n: p.grad for n, p in model.named_parameters()}
    same = sum(torch.equal(grads[n], g) for n, g in ref_grads.items())
    print(f"{len(batches)} micro-batches: max |loss - reference| {float((losses - ref_losses).abs().max()):.1e}, "
          f"{same}/{len(ref_grads)} gradients bit-identical; calls {runtime.calls}")
    assert torch.equal(losses, ref_losses) and same == len(ref_grads)
    assert runtime.calls == ["backward"] * (len(batches) - 1) + ["overlap", "backward"]
    assert [name for name, _, _ in timer.spans] == ["forward", "backward"] * len(batches)
    assert all(not r.loss.requires_grad and set(r.telemetry) >= {"rho_A", "core_rows"} for r in results)
    assert all(not v.requires_grad for r in results for v in r.telemetry.values() if torch.is_tensor(v))


def test_one_scale_per_micro_batch():
    model, batches = build("parcae")
    with pytest.raises(ValueError, match="one loss scale per micro-batch: got 2 scales for 5"):
        SingleProcessRuntime(torch.device("cpu")).run_micro_batches(model, batches, [0.5, 0.5])
