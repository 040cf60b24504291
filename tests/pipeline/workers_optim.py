"""Worker of the optimizer-sharding test: megaloop's combined optimizer (Muon + AdamW, clipping, schedules) built
with the runtime's distributed parts (distributed Muon, ZeRO-1 AdamW over the gradient buffer's chunks) and stepped
on synthetic full gradients in float64 (each rank takes its tensor-parallel shard; every dp rank holds the already
summed gradient, so no reduction runs). Saves the full parameters, grad norms, per-rank state bytes and the buffer's
chunking from rank 0."""
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
ORTH_DTYPE = torch.float64  # the whole step in float64: any layout must equal one process to rounding


def double_model(case: str) -> torch.nn.Module:
    return make_model(case).double()


def run_layout(case: str, tp: int):
    cfg = case_config(case)
    layout = init_layout(tp=tp, model=dims(cfg))
    runtime = ParallelRuntime(layout, plan_for(cfg), muon_functions(), zero_stage=1)
    full_model = double_model(case)
    model = double_model(case)
    runtime.prepare_model(model)
    opt = build_optimizer(model.named_parameters(), optim_config(), STEPS, parts=runtime.optimizer_parts())
    opt.muon.orth_dtype = ORTH_DTYPE
    norms = []
    for step in range(STEPS):
        grads = synthetic_grads(full_model, step)
        for name, p in model.named_parameters():
            spec = runtime.tp_info.shards.get(name)
            p.grad.copy_(grads[name] if spec is None else shard_tensor(grads[name], spec, layout.tp_rank))
        norms.append(opt.step(step).grad_norm)
        opt.zero_grad()
    runtime.finish_param_gather()  # no forward follows the last step to wait for the overlapped all-gather
    params = {n: gather_full(p.detach(), runtime.tp_info.shards.get(n), layout.tp_group)
              for n, p in model.named_parameters()}
    chunking = [(g.chunk_len, g.dp, sum(p.numel() for p in g.params), g.late, max(p.numel() for p in g.params))
                for g in runtime.buffer.groups]
    mine = {"muon": opt.muon.state_bytes(), "adamw": opt.adamw.state_bytes(), "muon_type": type(opt.muon).__name__,
            "adamw_type": type(opt.adamw).__name__, "chunking": chunking}
    per_rank = [None] * layout.world_size
    dist.all_gather_object(per_rank, mine)
    return {"params": params, "norms": norms, "bytes": per_rank, "dp": layout.dp, "tp": layout.tp}


def worker(rank: int, world: int, case: str, tps: list[int], out_path: str) -> None:
    results = {tp: run_layout(case, tp) for tp in tps}
    if rank == 0:
        torch.save(results, out_path)
