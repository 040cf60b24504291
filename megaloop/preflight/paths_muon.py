"""Distributed Muon (pipeline/dist_muon.py: each matrix orthogonalised by one owner rank, its update shared) with
ZeRO-1 AdamW and clipping, the combined optimizer as the trainer builds it under tp2 x dp (world / 2), stepped on
the same synthetic full-size gradients as megaloop's single-process optimizer: the parameters must agree (fp64 on
CPU: within 1e-12; fp32 on GPU)."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from megaloop.preflight.bandwidth import bus_bandwidth, expected_rate
from megaloop.preflight.context import Context
from megaloop.preflight.paths_train import MODEL, numel
from megaloop.preflight.report import PathResult

STEPS = 3
GPU_TOL = 1e-4


def synthetic_grads(model: torch.nn.Module, step: int) -> dict[str, torch.Tensor]:
    """Full-size gradients, a pure function of (parameter index, step)."""
    out = {}
    for index, (name, p) in enumerate(model.named_parameters()):
        g = torch.Generator().manual_seed(10_000 * step + index)
        out[name] = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.device, p.dtype)
    return out


def _build(cfg, device, dtype, fault: bool):
    from megaloop.model import build_model

    model = build_model(cfg.model, device=device, seed=cfg.train.seed).to(dtype)
    if fault:
        with torch.no_grad():
            next(iter(model.parameters())).add_(1e-3)
    return model


def _step_all(model, optimizer, set_grads, finish=lambda: None) -> list[float]:
    norms = []
    for step in range(STEPS):
        set_grads(step)
        norms.append(float(optimizer.step(step).grad_norm))
        finish()  # a parallel runtime's all-gather of the updated parameters (the comparison reads them)
        optimizer.zero_grad()
    return norms


def dist_muon(ctx: Context) -> PathResult:
    from megaloop.config import load_config
    from megaloop.optim import build_optimizer
    from megaloop.train.runtime import make_runtime
    from pipeline.tensor_parallel import gather_full, shard_tensor

    start = time.perf_counter()
    dtype = torch.float32 if ctx.on_gpu else torch.float64
    cfg = load_config(None, MODEL + ["parallel.tp=2", "parallel.zero_stage=1", "data.micro_batch_size=1",
                                     f"data.global_batch_size={ctx.world // 2}", "optim.grad_clip=1.0"],
                      world_size=ctx.world, validate=False)
    runtime = make_runtime(cfg, ctx.device)
    layout, reference = runtime.layout, _build(cfg, ctx.device, dtype, False)
    model = runtime.prepare_model(_build(cfg, ctx.device, dtype, ctx.faulty("dist_muon")))
    optimizer = build_optimizer(model.named_parameters(), cfg.optim, STEPS, parts=runtime.optimizer_parts())
    single = build_optimizer(reference.named_parameters(), cfg.optim, STEPS)
    optimizer.muon.orth_dtype = single.muon.orth_dtype = dtype
    shards = runtime.tp_info.shards

    def set_sharded(step):
        grads = synthetic_grads(reference, step)
        for name, p in model.named_parameters():
            full = grads[name]
            p.grad.copy_(full if name not in shards else shard_tensor(full, shards[name], layout.tp_rank))

    def set_full(step):
        for name, g in synthetic_grads(reference, step).items():
            dict(reference.named_parameters())[name].grad = g

    norms = _step_all(model, optimizer, set_sharded, runtime.finish_param_gather)
    ref_norms = _step_all(reference, single, set_full)
    ref_params = {n: p.detach() for n, p in reference.named_parameters()}
    worst = max(float((gather_full(p.detach(), shards.get(n), layout.tp_group) - ref_params[n]).abs().max()
                      / ref_params[n].abs().max().clamp_min(1e-30)) for n, p in model.named_parameters())
    worst = max(worst, max(abs(a - b) / b for a, b in zip(norms, ref_norms)))
    worst_all = torch.tensor([worst], dtype=torch.float64, device=ctx.device)
    dist.all_reduce(worst_all, op=dist.ReduceOp.MAX)
    tol = GPU_TOL if ctx.on_gpu else 1e-12
    bw = bus_bandwidth("all_gather", layout.dp_group, numel(ctx), ctx.device) if layout.dp_group else None
    expected_bw, link = expected_rate(ctx.device, ctx.spans_nodes(layout.dp_ranks))
    detail = (f"tp2 x dp{layout.dp}, {STEPS} steps of {type(optimizer.muon).__name__} + "
              f"{type(optimizer.adamw).__name__} in {str(dtype).removeprefix('torch.')}: worst rel err of the "
              f"parameters and grad norms {float(worst_all):.1e} (tol {tol:.0e}); all_gather over the dp group")
    return PathResult("dist_muon", float(worst_all) <= tol, detail, time.perf_counter() - start, bw, expected_bw,
                      link)
