"""Worker of the DeepSpeed test: megaloop's trainer (train(cfg, runtime)) at dp=2 under the native engine and under
DeepSpeed ZeRO 1, 2, 2 with CPU offload and 3, one run after another in one torch.distributed world; saves each
run's per-step losses, grad norms and full final parameters (gathered from the ZeRO partitions) from rank 0, and
the error a ZeRO-3 run with unequal loop counts per rank stops with."""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from megaloop.config import load_config
from megaloop.train.loop import train
from megaloop.train.runtime import make_runtime


def full_params(runtime) -> dict[str, torch.Tensor]:
    """Every parameter whole: the module's own under the native engine (dp only), DeepSpeed's fp32 master
    weights gathered from its partitions otherwise (a collective under ZeRO-3: every rank calls it)."""
    if getattr(runtime, "proxy", None) is None:
        return {n: p.detach().clone() for n, p in runtime.model.named_parameters()}
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in runtime.model.named_parameters()}


def grad_norms(out_dir: str) -> list[float]:
    path = Path(out_dir) / "metrics.jsonl"
    if not path.exists():  # only rank 0 writes metrics
        return []
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [r["grad_norm"] for r in records if r.get("kind") == "train"]


def run(config_path: str, overrides: list[str], offload: bool) -> dict:
    start = time.perf_counter()
    cfg = load_config(config_path, overrides)
    runtime = make_runtime(cfg, torch.device("cpu"))
    assert getattr(runtime, "offload", False) == offload  # parallel.zero_offload reached the runtime
    summary = train(cfg, runtime=runtime)
    proxy = getattr(runtime, "proxy", None)
    engine = type(proxy.engine.optimizer).__name__ if proxy is not None else type(runtime).__name__
    return {"losses": summary.losses, "norms": grad_norms(cfg.train.out_dir), "params": full_params(runtime),
            "engine": engine, "seconds": time.perf_counter() - start}


def unequal_loops_error(config_path: str, overrides: list[str]) -> str:
    """The message a ZeRO-3 run with per-sequence depths (different loop counts per rank) stops with."""
    cfg = load_config(config_path, overrides)
    try:
        train(cfg, runtime=make_runtime(cfg, torch.device("cpu")))
    except RuntimeError as err:
        return str(err)
    return ""


def worker(rank: int, world: int, config_path: str, runs: dict, unequal: list[str], out_path: str) -> None:
    """runs: {label: (overrides, offload)}; unequal: overrides of a ZeRO-3 run expected to stop with the error."""
    results = {label: run(config_path, overrides, offload) for label, (overrides, offload) in runs.items()}
    results["zero3_unequal"] = unequal_loops_error(config_path, unequal)
    if rank == 0:
        torch.save(results, out_path)
