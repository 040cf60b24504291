"""Worker of the layout-equivalence test: megaloop's trainer (train(cfg, runtime)) on several layouts in turn,
inside one torch.distributed world; saves per-step losses and the full final parameters from rank 0."""
from __future__ import annotations

import torch

from megaloop.config import load_config
from megaloop.train.loop import train
from megaloop.train.runtime import SingleProcessRuntime, make_runtime
from pipeline.tensor_parallel import gather_full

# Polar Express in fp32 (the trainer's fp32 run otherwise orthogonalises in bf16, whose roundings amplify the
# float reduction-order differences of other layouts to ~1e-3 of single entries).
ORTH_DTYPE = torch.float32


def set_orth_dtype(optimizer) -> None:
    if getattr(optimizer, "muon", None) is not None:
        optimizer.muon.orth_dtype = ORTH_DTYPE


class ReferenceRuntime(SingleProcessRuntime):
    """The single-process runtime, keeping the model and running Muon's iteration in fp32."""

    def prepare_model(self, model):
        self.model = model
        return model

    def prepare_optimizer(self, optimizer):
        set_orth_dtype(optimizer)
        return optimizer


def traced_runtime(cfg, device):
    """The trainer's own runtime for this world, with Muon's iteration in fp32."""
    runtime = make_runtime(cfg, device)
    prepare = runtime.prepare_optimizer

    def prepare_optimizer(optimizer):
        set_orth_dtype(optimizer)
        return prepare(optimizer)

    runtime.prepare_optimizer = prepare_optimizer
    return runtime


def run(config_path: str, overrides: list[str], runtime_factory):
    cfg = load_config(config_path, overrides)
    runtime = runtime_factory(cfg, torch.device("cpu"))
    summary = train(cfg, runtime=runtime)
    tp_info = getattr(runtime, "tp_info", None)
    group = runtime.layout.tp_group if hasattr(runtime, "layout") else None
    params = {n: gather_full(p.detach(), tp_info.shards.get(n) if tp_info else None, group)
              for n, p in runtime.model.named_parameters()}
    return {"losses": summary.losses, "params": params}


def worker(rank: int, world: int, config_path: str, runs: dict, out_path: str) -> None:
    """runs: {label: overrides}; every run uses this world's processes with its own parallel.* overrides."""
    results = {label: run(config_path, overrides, traced_runtime) for label, overrides in runs.items()}
    if rank == 0:
        torch.save(results, out_path)
