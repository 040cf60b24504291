"""Worker of the optimizer-sharding test: megaloop's combined optimizer (Muon + AdamW, clipping, schedules) made
distributed by the runtime (distributed Muon, ZeRO-1 AdamW) and stepped on synthetic full gradients (each rank
takes its tensor-parallel shard). Saves the full parameters, grad norms and per-rank state bytes from rank 0."""
from __future__ import annotations

import torch
import torch.distributed as dist

from megaloop.optim import build_optimizer
from pipeline.layout import init_layout
from pipeline.runtime import ParallelRuntime
from pipeline.tensor_parallel import gather_full, shard_tensor
from tests.pipeline.models import (case_config, dims, make_model, muon_functions, optim_config, plan_for,
                                   synthetic_grads)

STEPS = 3
# Polar Express in fp32: in bf16 a 1e-6 change of the gradient (the norm of a split tensor rounds differently, so
# the clip coefficient does) flips roundings that the iteration amplifies to ~1e-2 of some update entries.
ORTH_DTYPE = torch.float32


def clip_for(tp: int) -> float:
    """Clipping that bites without tensor parallelism (where the norm is bitwise the single-process one); a clip
    that never bites under tp: there the fp32 norm of a split tensor rounds differently (~1e-6), and Muon's
    cautious weight decay, a step function of sign(update * param), turns that into 1e-3 errors of a few entries.
    The norm itself is compared in both cases."""
    return 1.0 if tp == 1 else 1e6


def run_layout(case: str, tp: int):
    cfg = case_config(case)
    layout = init_layout(tp=tp, model=dims(cfg))
    runtime = ParallelRuntime(layout, plan_for(cfg), muon_functions(), zero_stage=1)
    full_model = make_model(case)
    model = make_model(case)
    runtime.prepare_model(model)
    opt = build_optimizer(model.named_parameters(), optim_config(grad_clip=clip_for(tp)), STEPS,
                          norm_sq_reduce=runtime.norm_sq_reduce())
    opt.muon.orth_dtype = ORTH_DTYPE
    opt = runtime.prepare_optimizer(opt)
    norms = []
    for step in range(STEPS):
        grads = synthetic_grads(full_model, step)
        for name, p in model.named_parameters():
            spec = runtime.tp_info.shards.get(name)
            p.grad = grads[name] if spec is None else shard_tensor(grads[name], spec, layout.tp_rank)
        norms.append(opt.step(step).grad_norm)
        opt.zero_grad()
    params = {n: gather_full(p.detach(), runtime.tp_info.shards.get(n), layout.tp_group)
              for n, p in model.named_parameters()}
    mine = {"muon": opt.muon.state_bytes(), "adamw": opt.adamw.state_bytes() if hasattr(opt.adamw, "state_bytes")
            else None, "muon_type": type(opt.muon).__name__, "adamw_type": type(opt.adamw).__name__}
    per_rank = [None] * layout.world_size
    dist.all_gather_object(per_rank, mine)
    return {"params": params, "norms": norms, "bytes": per_rank, "dp": layout.dp, "tp": layout.tp}


def worker(rank: int, world: int, case: str, tps: list[int], out_path: str) -> None:
    results = {tp: run_layout(case, tp) for tp in tps}
    if rank == 0:
        torch.save(results, out_path)
