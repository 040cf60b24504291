"""Worker of the trainer-build tests: megaloop's own build (megaloop.train.loop.build_model_and_optimizer with the
runtime make_runtime gives) under several layouts in turn inside one torch.distributed world. Every rank saves, per
layout, where it sits in the layout, the names its model holds, which parameters of its whole (meta-built) model are
allocated, and the values of what it holds gathered over tensor parallelism (fp64 or fp32 as built)."""
from __future__ import annotations

import torch

from megaloop.config import load_config
from megaloop.train.loop import build_model_and_optimizer
from megaloop.train.runtime import make_runtime
from pipeline.tensor_parallel import gather_full


def build_report(config_path: str, overrides: list[str]) -> dict:
    """One rank's view of the trainer's build under the layout the overrides set."""
    cfg = load_config(config_path, overrides)
    runtime = make_runtime(cfg, torch.device("cpu"))
    model, optimizer = build_model_and_optimizer(cfg, runtime, torch.device("cpu"))
    layout, shards = runtime.layout, runtime.tp_info.shards
    held = [n for n, _ in model.named_parameters()]
    report = {
        "pp": layout.pp, "stage": layout.pp_rank, "tp_rank": layout.tp_rank, "dp_rank": layout.dp_rank,
        "held": held,
        "allocated": [n for n, p in runtime.model.named_parameters() if not p.is_meta],
        "full": {n: gather_full(p.detach(), shards.get(n), layout.tp_group).clone()
                 for n, p in model.named_parameters()},
    }
    del model, optimizer  # they hold process groups; the next layout makes its own
    return report


def build_worker(rank: int, world: int, config_path: str, runs: dict, out_path: str, threads: int = 1) -> None:
    """runs: {label: overrides}; saves {label: report} of this rank to f"{out_path}.{rank}". torch runs on `threads`
    threads."""
    torch.set_num_threads(threads)
    torch.save({label: build_report(config_path, overrides) for label, overrides in runs.items()},
               f"{out_path}.{rank}")


def rank_findings(report: dict, eager: dict, expected: list[str]) -> dict:
    """One rank's report against the eager single-process build and its stage's names: whether it holds exactly those
    names (once each), whether nothing else of its model is allocated, and how many held values equal the eager
    build's bit for bit."""
    held = report["held"]
    return {"names": len(held) == len(set(held)) and sorted(held) == sorted(expected),
            "only_held": sorted(report["allocated"]) == sorted(expected),
            "equal": sum(torch.equal(report["full"][n], eager[n]) for n in held), "held": len(held)}


def holder_counts(reports: list[dict]) -> dict[str, int]:
    """How many ranks hold each parameter name."""
    counts: dict[str, int] = {}
    for r in reports:
        for n in r["held"]:
            counts[n] = counts.get(n, 0) + 1
    return counts
