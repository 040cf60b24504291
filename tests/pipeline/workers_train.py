"""Worker of the layout-equivalence test: megaloop's trainer (train(cfg, runtime)) on several layouts in turn,
inside one torch.distributed world; saves per-step losses and the full final parameters from rank 0."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from megaloop.config import load_config
from megaloop.train.loop import train
from megaloop.train.metrics import MetricsWriter
from megaloop.train.runtime import SingleProcessRuntime, make_runtime
from pipeline.tensor_parallel import gather_full


def set_orth_dtype(optimizer) -> None:
    """Polar Express in at least fp32 (the trainer's fp32 run otherwise orthogonalises in bf16, as the reference
    does, whose roundings amplify the reduction-order differences of other layouts)."""
    if getattr(optimizer, "muon", None) is not None and optimizer.muon.orth_dtype == torch.bfloat16:
        optimizer.muon.orth_dtype = torch.float32


class ReferenceRuntime(SingleProcessRuntime):
    """The single-process runtime, keeping the model and running Muon's iteration in fp32."""

    def prepare_model(self, model, materialize=None):
        self.model = super().prepare_model(model, materialize)
        return self.model

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


def run_summary(config_path: str, overrides: list[str], runtime_factory, after=None):
    """train(cfg, runtime) with the runtime runtime_factory(cfg, cpu) makes; after(runtime, model), when given, is
    called with the trained model after the training (the run summary is returned)."""
    cfg = load_config(config_path, overrides)
    runtime = runtime_factory(cfg, torch.device("cpu"))
    if after is not None:
        prepare = runtime.prepare_model
        kept = {}

        def prepare_model(*args, **kwargs):
            kept["model"] = prepare(*args, **kwargs)
            return kept["model"]

        runtime.prepare_model = prepare_model
    summary = train(cfg, runtime=runtime)
    if after is not None:
        after(runtime, kept.pop("model"))
    return summary


def run(config_path: str, overrides: list[str], runtime_factory):
    cfg = load_config(config_path, overrides)
    runtime = runtime_factory(cfg, torch.device("cpu"))
    summary = train(cfg, runtime=runtime)
    tp_info = getattr(runtime, "tp_info", None)
    group = runtime.layout.tp_group if runtime.layout is not None else None
    params = {n: gather_full(p.detach(), tp_info.shards.get(n) if tp_info else None, group)
              for n, p in runtime.model.named_parameters()}
    reducer = getattr(runtime, "reducer", None)
    return {"losses": summary.losses, "params": params,
            "overlapped": reducer.launched_in_backward if reducer is not None and reducer.group is not None else None}


def worker(rank: int, world: int, config_path: str, runs: dict, out_path: str) -> None:
    """runs: {label: overrides}; every run uses this world's processes with its own parallel.* overrides."""
    results = {label: run(config_path, overrides, traced_runtime) for label, overrides in runs.items()}
    if rank == 0:
        torch.save(results, out_path)


def gloo_threads() -> int:
    """This process's OS threads that belong to gloo process groups (named gloo_tcp_loop and pt_gloo_runloop)."""
    names = [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task")]
    return sum("gloo" in name for name in names)


def teardown_worker(rank: int, world: int, config_path: str, overrides: list[str], out_path: str) -> None:
    """The trainer owning its runtime, as `python -m megaloop train` runs it: gloo threads during the job (counted
    from the last metrics call) and after train() returned (none may be left, see destroy_layout)."""
    during = []
    writer_write = MetricsWriter.write

    def write(self, record):
        during.append(gloo_threads())
        return writer_write(self, record)

    MetricsWriter.write = write
    train(load_config(config_path, overrides))
    torch.save({"during": max(during), "after": gloo_threads()}, f"{out_path}.{rank}")


def sharded_build_worker(rank: int, world: int, config_path: str, overrides: list[str], out_path: str) -> None:
    """build_model_and_optimizer under this world's layout (tp > 1: meta build + held parameters only) against an
    eager single-process build cut by the same shard specs: how many parameters are bit-identical, and the bytes
    this rank holds against the whole model's."""
    from megaloop.model import build_model
    from megaloop.train.loop import build_model_and_optimizer
    from megaloop.train.precision import param_dtype
    from pipeline.tensor_parallel import shard_tensor

    cfg = load_config(config_path, overrides)
    runtime = make_runtime(cfg, torch.device("cpu"))
    model, _ = build_model_and_optimizer(cfg, runtime, torch.device("cpu"))
    reference = dict(build_model(cfg.model, seed=cfg.train.seed).to(param_dtype(cfg.train.precision))
                     .named_parameters())
    shards, tp_rank = runtime.tp_info.shards, runtime.tp_info.tp_rank
    held = dict(runtime.model.named_parameters())
    equal = sum(torch.equal(p, shard_tensor(reference[n], shards[n], tp_rank) if n in shards else reference[n])
                for n, p in held.items())
    rope = torch.equal(runtime.model.rope_cos, build_model(cfg.model, seed=0).to(param_dtype(cfg.train.precision))
                       .rope_cos)
    torch.save({"params": len(held), "equal": equal, "rope": rope, "split": len(shards),
                "held_bytes": sum(p.numel() * p.element_size() for p in held.values()),
                "full_bytes": sum(p.numel() * p.element_size() for p in reference.values()),
                "dtype": str(next(iter(held.values())).dtype)}, f"{out_path}.{rank}")
    runtime.close()
