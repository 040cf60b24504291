"""Worker of the pipeline-parallel trainer tests: megaloop's trainer under a layout with pp > 1 (train(cfg,
runtime) with the trainer's own runtime), on several runs in turn inside one torch.distributed world; rank 0 saves
per-step losses and the full final parameters, gathered over tensor parallelism and then over the pipeline stages
(the tied embedding from both of its stages, which must hold the same values)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from pipeline.tensor_parallel import gather_full
from tests.pipeline.workers_train import run_summary, traced_runtime


def stage_params(runtime, model) -> list[dict]:
    """Every rank's {name: full parameter} of what its stage holds (tp pieces gathered), in rank order."""
    shards, group = runtime.tp_info.shards, runtime.layout.tp_group
    mine = {n: gather_full(p.detach(), shards.get(n), group).clone() for n, p in model.named_parameters()}
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def run_pp(config_path: str, overrides: list[str]) -> dict:
    result = {}

    def keep(runtime, model):
        result["stages"] = stage_params(runtime, model)

    summary = run_summary(config_path, overrides, traced_runtime, after=keep)
    params, copies = {}, {}
    for held in result["stages"]:
        for name, value in held.items():
            copies.setdefault(name, []).append(value)
            params.setdefault(name, value)
    spread = max(float((v - vs[0]).abs().max()) for vs in copies.values() for v in vs)
    return {"losses": summary.losses, "params": params, "copies_spread": spread, "val": summary.val}


def worker(rank: int, world: int, config_path: str, runs: dict, out_path: str) -> None:
    results = {label: run_pp(config_path, overrides) for label, overrides in runs.items()}
    if rank == 0:
        torch.save(results, out_path)
