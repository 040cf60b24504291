"""The time planner's part of `python -m megaloop plan`: its flags, the step-time section of one layout, and
`--search`."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from megaloop.config import Config, ConfigError, load_config
from megaloop.plan.checkpoint_cost import CheckpointCost, checkpoint_cost, checkpoint_lines
from megaloop.plan.comm import Cluster, DpComm, Link
from megaloop.plan.gpus import GPUS, Gpu
from megaloop.plan.planner import Plan
from megaloop.plan.run_length import RunLength, run_length
from megaloop.plan.search import Estimate, Planner, peak_bytes, search
from megaloop.plan.time_model import DEFAULT_EFFICIENCY, device_for, time_plan
from megaloop.plan.time_report import assumptions, ranking_lines, time_lines

DEFAULT_TOP = 20


def add_time_arguments(p) -> None:
    p.add_argument("--mfu", type=float, default=DEFAULT_EFFICIENCY, metavar="E",
                   help=f"the fraction of the dense peak the model's FLOPs run at (default {DEFAULT_EFFICIENCY})")
    p.add_argument("--peak-tflops", type=float, default=None, metavar="T",
                   help="dense peak per GPU in TFLOP/s (default: NVIDIA's bf16 figure; cpu: the cached measurement "
                   "of `python -m megaloop peak`)")
    p.add_argument("--tokens", type=float, default=None, metavar="N", help="token budget, e.g. 100e9: prints the "
                   "days and GPU-hours it takes (default: the config's run, train.tokens or train.steps)")
    p.add_argument("--intra-gbps", type=float, default=450.0, metavar="B",
                   help="intra-node bus bandwidth per GPU and direction, GB/s (default 450: NVLink 4)")
    p.add_argument("--intra-latency-us", type=float, default=1.0, metavar="US",
                   help="intra-node latency per ring step, microseconds (default 1)")
    p.add_argument("--inter-gbps", type=float, default=50.0, metavar="B",
                   help="inter-node bandwidth per GPU (its NIC), GB/s (default 50: 400 Gb/s InfiniBand)")
    p.add_argument("--inter-latency-us", type=float, default=5.0, metavar="US",
                   help="inter-node latency per ring step, microseconds (default 5)")
    p.add_argument("--buckets", choices=("fixed", "scaled"), default="scaled",
                   help="data-parallel buckets: fixed 25 MiB, or scaled max(40M, 1M x dp) elements (default)")
    p.add_argument("--param-gather", choices=("exposed", "overlapped"), default="overlapped",
                   help="ZeRO-1 parameter all-gather after the optimizer step (exposed) or behind the next forward "
                   "(overlapped, the default)")
    p.add_argument("--storage-gbps", type=float, default=10.0, metavar="B",
                   help="aggregate write bandwidth of the checkpoint file system, GB/s (default 10): the checkpoint "
                   "cost and what a failure loses")
    p.add_argument("--search", action="store_true", help="rank the layouts (tp, pp, dp, micro-batch, activation "
                   "checkpointing, grad_reduce_dtype) that fit the GPU by predicted step time")
    p.add_argument("--top", type=int, default=DEFAULT_TOP, metavar="K", help=f"--search: print the K fastest "
                   f"(default {DEFAULT_TOP})")


def _check(args) -> None:
    for name in ("mfu", "peak_tflops", "tokens", "intra_gbps", "inter_gbps", "top", "storage_gbps"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ConfigError("--" + name.replace("_", "-"), value, "must be > 0")
    if not args.mfu <= 1:
        raise ConfigError("--mfu", args.mfu, "must be <= 1: the fraction of the dense peak reached")
    for name in ("intra_latency_us", "inter_latency_us"):
        if getattr(args, name) < 0:
            raise ConfigError("--" + name.replace("_", "-"), getattr(args, name), "must be >= 0")


def job_gpu(name: str) -> Gpu:
    """The memory the planner fits into: a GPU of the table, or this machine's memory for "cpu"."""
    if name == "cpu":
        return Gpu("CPU", os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return GPUS[name]


def resolved_precision(cfg: Config, gpu: str) -> Config:
    """train.precision=auto as it resolves on the device (a GPU: bf16)."""
    if cfg.train.precision != "auto":
        return cfg
    if gpu != "cpu":
        return cfg.with_precision("bf16")
    import torch

    from megaloop.train.precision import resolve_precision

    return cfg.with_precision(resolve_precision("auto", torch.device("cpu")).precision)


def planner_for(args, cfg: Config, world: int) -> Planner:
    _check(args)
    cluster = Cluster(args.gpus_per_node, Link(args.intra_gbps * 1e9, args.intra_latency_us * 1e-6),
                      Link(args.inter_gbps * 1e9, args.inter_latency_us * 1e-6))
    device = device_for(args.gpu, cfg.train.precision, args.mfu, args.peak_tflops,
                        fp8=getattr(cfg.train, "fp8", "none") != "none")
    comm = DpComm(args.buckets, args.param_gather == "overlapped")
    return Planner(job_gpu(args.gpu), world, device, cluster, comm, args.in_flight)


@dataclass
class TimeSection:
    est: Estimate
    planner: Planner
    run: RunLength
    checkpoint: CheckpointCost
    storage_gbps: float

    def merged(self, memory: dict) -> dict:
        """The memory plan's dict with the time keys and "checkpoint"; its "layout" gains micro_batch,
        activation_checkpointing and grad_reduce_dtype."""
        out = self.est.as_dict(self.run)
        layout = memory.get("layout", {}) | out.pop("layout")
        return memory | out | {"layout": layout, "checkpoint": self.checkpoint.as_dict()}

    def text(self) -> str:
        p = self.planner
        lines = time_lines(self.est, self.run, p.device, p.cluster, p.comm)
        return "\n" + "\n".join(lines + checkpoint_lines(self.checkpoint, self.est.plan.cfg, self.storage_gbps))


def time_section(args, plan: Plan) -> TimeSection:
    """The time plan of the memory plan `plan`, with what its checkpoints cost."""
    planner = planner_for(args, plan.cfg, plan.layout.world)
    est = Estimate(plan, time_plan(plan, planner.device, planner.cluster, planner.comm), peak_bytes(plan))
    cost = checkpoint_cost(plan, est.time.step_time_s, args.storage_gbps)
    return TimeSection(est, planner, run_length(plan.cfg, args.tokens), cost, args.storage_gbps)


def run_search(args, overrides: list[str], world: int) -> int:
    base = resolved_precision(load_config(args.config, overrides, validate=False), args.gpu)
    planner = planner_for(args, base, world)
    overrides = list(overrides) + [f"train.precision={base.train.precision}"]
    found = search(args.config, overrides, planner, args.gpus_per_node)
    run = run_length(base, args.tokens)
    if args.json:
        print(json.dumps([e.as_dict(run) for e in found[:args.top]]))
        return 0 if found else 1
    lines = [f"layouts of {args.config} on {world} x {planner.gpu.name} ({args.nodes} nodes of {args.gpus_per_node})"
             f" that fit, fastest first: {len(found)} found"
             + (f", the {min(args.top, len(found))} fastest shown" if len(found) > args.top else ""),
             *assumptions(planner.device, planner.cluster, planner.comm), *ranking_lines(found, run,
                                                                                         args.top)]
    print("\n".join(lines))
    return 0 if found else 1
