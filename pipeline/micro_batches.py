"""A step's micro-batches run one after the other: forward, loss times its scale, backward; the plain loop every
runtime without pipeline parallelism shares (ParallelRuntime, the DeepSpeed runtime through it, and megaloop's
SingleProcessRuntime). A pipeline runtime runs the same list as its ring schedule instead.

A micro-batch is any object with the fields of megaloop.model.stages.StageMicroBatch (input_ids, labels, depth,
backprop_depth, noise_key, h0); the model is called as model(input_ids, labels=..., depth=..., backprop_depth=...,
h0=..., noise_key=...) and returns an object with `.loss` (0-dim) and `.telemetry` (a dict). Nothing here reads a
value back from the device: the losses and telemetry stay device tensors (detached).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Sequence

import torch


@dataclass
class MicroBatchResult:
    """One micro-batch's outcome: its unscaled loss (detached) and the model's telemetry (tensors detached)."""

    loss: torch.Tensor
    telemetry: dict


class NoTimer:
    """The timer protocol (mark() -> a time point; add(span, start, end)) that records nothing."""

    def mark(self):
        return None

    def add(self, name: str, start, end) -> None:
        return None


def run_micro_batches(runtime, model, micro_batches: Sequence, scales: Sequence[float],
                      autocast: Callable[[], ContextManager] = contextlib.nullcontext,
                      timer=None) -> list[MicroBatchResult]:
    """Forward each micro-batch under `autocast()`, then runtime.backward(loss x its scale); before the last backward
    runtime.overlap_next_backward() (gradients are final in it: a data-parallel reducer starts on full buckets).
    `timer` (see NoTimer) gets a "forward" and a "backward" span per micro-batch. Returns the results in order."""
    if len(scales) != len(micro_batches):
        raise ValueError(f"one loss scale per micro-batch: got {len(scales)} scales for {len(micro_batches)} "
                         "micro-batches")
    timer = timer or NoTimer()
    results = []
    for i, (mb, scale) in enumerate(zip(micro_batches, scales)):
        t0 = timer.mark()
        with autocast():
            out = model(mb.input_ids, labels=mb.labels, depth=mb.depth, backprop_depth=mb.backprop_depth, h0=mb.h0,
                        noise_key=mb.noise_key)
        t1 = timer.mark()
        if i == len(micro_batches) - 1:
            runtime.overlap_next_backward()
        runtime.backward(out.loss * scale)
        timer.add("forward", t0, t1)
        timer.add("backward", t1, timer.mark())
        results.append(MicroBatchResult(out.loss.detach(), _detached(out.telemetry)))
    return results


def plain_forward_losses(model, micro_batches: Sequence, autocast: Callable[[], ContextManager] = contextlib.nullcontext
                         ) -> list[float]:
    """Each micro-batch's mean token loss from model(...) under autocast() without autograd (validation); reads
    every loss back to the host."""
    losses = []
    with torch.no_grad():
        for mb in micro_batches:
            with autocast():
                out = model(mb.input_ids, labels=mb.labels, depth=mb.depth, backprop_depth=mb.backprop_depth,
                            h0=mb.h0, noise_key=mb.noise_key)
            losses.append(float(out.loss))
    return losses


def _detached(telemetry: dict) -> dict:
    return {k: v.detach() if torch.is_tensor(v) else v for k, v in telemetry.items()}

