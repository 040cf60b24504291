"""`python -m megaloop plan CONFIG --gpu h100 --nodes N --gpus-per-node G [--pp P] [--tokens T] [--search] [--json]`."""
from __future__ import annotations

import json

from megaloop.config import ConfigError, load_config
from megaloop.plan.gpus import GPUS
from megaloop.plan.pipeline import IN_FLIGHT_PER_STAGE
from megaloop.plan.planner import make_plan
from megaloop.plan.report import plan_dict, plan_text


def add_arguments(p) -> None:
    p.add_argument("--gpu", default="h100", type=str.lower, choices=sorted(GPUS) + ["cpu"],  # H100 as well
                   help="GPU type (memory size and dense peak, any case); cpu: this machine (its memory, its "
                   "cached matmul peak); default h100")
    p.add_argument("--nodes", type=int, required=True, metavar="N", help="nodes of the job")
    p.add_argument("--gpus-per-node", type=int, required=True, metavar="G", help="GPUs per node")
    p.add_argument("--pp", type=int, default=None, metavar="P",
                   help="pipeline stages (sets parallel.pp; default: the config's): with P > 1, each ring stage's "
                   "parameters, gradients, optimizer state and stored activations, and the simulated ring "
                   "schedule of one optimizer step (makespan, idle fraction per stage)")
    p.add_argument("--in-flight", type=int, default=None, metavar="K",
                   help="ring pipeline: at most K x P micro-batches hold lap activations at once, 2 K x P are "
                   "open (sets parallel.pp_in_flight; default: the config's, "
                   f"{IN_FLIGHT_PER_STAGE} unless set)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    from megaloop.plan.time_cli import add_time_arguments

    add_time_arguments(p)


def run_plan(args) -> int:
    """Load and check the config for the job's GPU count (as `launch` does, but a valid pp > 1 layout passes),
    then print the plan; a job that cannot run raises ConfigError."""
    for name in ("nodes", "gpus_per_node", "in_flight"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError("--" + name.replace("_", "-"), getattr(args, name), "must be >= 1")
    world = args.nodes * args.gpus_per_node
    overrides = list(args.overrides) + ([f"parallel.pp={args.pp}"] if args.pp is not None else [])
    overrides += [f"parallel.pp_in_flight={args.in_flight}"] if args.in_flight is not None else []
    from megaloop.plan.time_cli import job_gpu, resolved_precision, run_search, time_section

    if args.search:
        return run_search(args, overrides, world)
    cfg = resolved_precision(load_config(args.config, overrides, world_size=world), args.gpu)
    plan = make_plan(cfg, job_gpu(args.gpu), world, cfg.parallel.pp_in_flight)
    section = time_section(args, plan)
    if args.json:
        print(json.dumps(section.merged(plan_dict(plan, world, args.nodes))))
    else:
        print(plan_text(plan, world, args.nodes, args.config) + section.text())
    return 0
