"""The looped model as ring-pipeline stages (megaloop.model.stages) on one rank, and the one-process reference it
must equal: parcae-tiny (4 core blocks, short sequences, small vocabulary), its RDM and GPT variants in float64,
optionally with activation checkpointing, with micro-batches whose per-sequence depths differ within and between
micro-batches and truncated backprop k_i = min(T_i, ceil(mu_rec / 2)); and the memory runs, whose micro-batches
loop n + 2 laps with gradient through the last 2 or through all of them."""
from __future__ import annotations

import datetime
import math
from pathlib import Path

import torch
import torch.distributed as dist

from megaloop.config import load_config
from megaloop.model import build_model
from megaloop.model.stages import LoopedStageProgram, StageMicroBatch
from pipeline.ring import MicroBatch, ring_schedule
from pipeline.ring.execute import RingExecutor

TINY = Path(__file__).resolve().parents[2] / "configs" / "parcae-tiny.yaml"
SMALL = ["model.n_core=4", "model.seq_len=8", "model.vocab_size=64", "model.d_model=64", "model.n_heads=2"]
ARCH = {
    "parcae": [],
    "rdm": ["model.arch=rdm", "model.injection=concat", "model.block=sandwich", "model.use_C=false"],
    "gpt": ["model.arch=gpt", "model.injection=none", "model.prelude_norm=false", "model.use_C=false",
            "model.mu_rec=1", "model.mu_bwd=1", "model.depth_sampler=fixed", "model.n_prelude=0", "model.n_coda=0"],
}
# per-sequence depths of each micro-batch: lap counts 7, 3, 5, 1, 6; rows that start in different laps
DEPTHS = [[3, 7, 1, 5], [2, 3], [5, 1, 4], [1, 1], [6, 2, 6, 3]]
STEP, SEED = 3, 11


def build(case: str):
    """The float64 model of `case` ("arch" or "arch+checkpointing"; the reference init, then every parameter
    perturbed: the init zeroes the output projections, which would leave most gradients zero) and its
    micro-batches (GPT: every depth 1; micro-batch 1 with its h_0 given, the others' drawn from their noise keys)."""
    arch, _, checkpointing = case.partition("+")
    cfg = load_config(TINY, SMALL + ARCH[arch]).model
    model = build_model(cfg, seed=0).double()
    model.set_activation_checkpointing(checkpointing or "none")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    k = math.ceil(cfg.mu_rec / 2)
    batches, start = [], 0
    for mb, depth in enumerate(DEPTHS):
        rows = len(depth)
        depth = [1] * rows if cfg.injection == "none" else depth
        gen = torch.Generator().manual_seed(100 + mb)
        ids = torch.randint(cfg.vocab_size, (rows, cfg.seq_len), generator=gen)
        labels = torch.randint(cfg.vocab_size, (rows, cfg.seq_len), generator=gen)
        labels[:, :2] = -100
        index = torch.arange(start, start + rows)
        start += rows
        h0 = torch.randn(rows, cfg.seq_len, cfg.d_model, generator=gen, dtype=torch.float64) if mb == 1 else None
        batches.append(StageMicroBatch(ids, labels, depth, [min(t, k) for t in depth], (SEED, STEP, index), h0))
    return model, batches


def scales(batches) -> list[float]:
    """The trainer's factor: each micro-batch's share of the step's labelled positions."""
    tokens = [int((b.labels != -100).sum()) for b in batches]
    return [t / sum(tokens) for t in tokens]


def reference(case: str):
    """One process: LoopedLM.forward on each micro-batch, loss times its scale, backward; losses and gradients."""
    model, batches = build(case)
    losses = []
    for batch, scale in zip(batches, scales(batches)):
        out = model(batch.input_ids, batch.labels, batch.depth, batch.backprop_depth, batch.h0, batch.noise_key)
        loss = out.loss * scale
        loss.backward()
        losses.append(loss.detach())
    return torch.stack(losses), {n: p.grad for n, p in model.named_parameters()}


def run_stage(rank: int, world: int, case: str):
    """This rank's stage under the ring schedule, messages checked: (losses on the last rank, nonzero grads)."""
    model, batches = build(case)
    program = LoopedStageProgram(model, rank, world, batches, scales(batches))
    specs = [MicroBatch(**spec) for spec in program.specs()]
    actions = ring_schedule(specs, world, max_in_flight=2)[rank]
    result = RingExecutor(program, dtype=torch.float64, check_messages=True).run(actions, specs)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().max() > 0}
    return result.losses, grads


def worker(rank: int, world: int, cases: list, out: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    results = {case: run_stage(rank, world, case) for case in cases}
    torch.save(results, f"{out}.{rank}")


# laps without gradient in the deepest row of every micro-batch of the memory runs; GRAD_LAPS laps with gradient
NO_GRAD_LAPS, GRAD_LAPS = (4, 16, 64), 2


def memory_batches(model, n: int, full: bool) -> list[StageMicroBatch]:
    """Three micro-batches whose deepest rows run n + GRAD_LAPS laps, with rows that join the ragged loop late
    (depths n/2 + 2, 3 and 1); backprop depths min(T_i, GRAD_LAPS), or every lap (`full`)."""
    cfg = model.cfg
    depths = [[n + GRAD_LAPS, n + GRAD_LAPS], [n + GRAD_LAPS, n // 2 + GRAD_LAPS, 3], [1, n + GRAD_LAPS]]
    batches, start = [], 0
    for mb, depth in enumerate(depths):
        gen = torch.Generator().manual_seed(200 + mb)
        ids = torch.randint(cfg.vocab_size, (len(depth), cfg.seq_len), generator=gen)
        index = torch.arange(start, start + len(depth))
        start += len(depth)
        kept = depth if full else [min(t, GRAD_LAPS) for t in depth]
        batches.append(StageMicroBatch(ids, ids.clone(), depth, kept, (SEED, STEP, index)))
    return batches


def memory_worker(rank: int, world: int, out: str) -> None:
    """This rank's (peak stored groups, peak autograd-saved bytes) for every n of NO_GRAD_LAPS, with truncated
    backprop (False) and with gradient through every lap (True)."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    model = build_model(load_config(TINY, SMALL).model, seed=0).double()
    peaks = {}
    for full in (False, True):
        for n in NO_GRAD_LAPS:
            batches = memory_batches(model, n, full)
            program = LoopedStageProgram(model, rank, world, batches, 1 / len(batches))
            specs = [MicroBatch(**spec) for spec in program.specs()]
            actions = ring_schedule(specs, world, max_in_flight=2)[rank]
            result = RingExecutor(program, dtype=torch.float64).run(actions, specs)
            peaks[full, n] = (result.peak_stored, result.peak_saved_bytes)
    torch.save(peaks, f"{out}.{rank}")
