"""`python -m megaloop plan CONFIG --gpu h100 --nodes N --gpus-per-node G [--json]`."""
from __future__ import annotations

import json

from megaloop.config import ConfigError, load_config
from megaloop.plan.gpus import GPUS, gpu
from megaloop.plan.planner import make_plan
from megaloop.plan.report import plan_dict, plan_text


def add_arguments(p) -> None:
    p.add_argument("--gpu", default="h100", choices=sorted(GPUS), help="GPU type (memory size); default h100")
    p.add_argument("--nodes", type=int, required=True, metavar="N", help="nodes of the job")
    p.add_argument("--gpus-per-node", type=int, required=True, metavar="G", help="GPUs per node")
    p.add_argument("--pp", type=int, default=1, metavar="P",
                   help="pipeline stages: planning the ring pipeline is a later step, only 1 is accepted")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")


def run_plan(args) -> int:
    """Load and check the config for the job's GPU count (as `launch` does), then print the plan; a job that cannot
    run raises ConfigError."""
    if args.pp != 1:
        raise ConfigError("--pp", args.pp, "memory planning for the ring pipeline (pp > 1) is a later step; plan "
                          "with --pp 1 (parallel.pp must be 1 too)")
    for name in ("nodes", "gpus_per_node"):
        if getattr(args, name) < 1:
            raise ConfigError("--" + name.replace("_", "-"), getattr(args, name), "must be >= 1")
    world = args.nodes * args.gpus_per_node
    cfg = load_config(args.config, args.overrides, world_size=world)
    plan = make_plan(cfg, gpu(args.gpu), world)
    if args.json:
        print(json.dumps(plan_dict(plan, world, args.nodes)))
    else:
        print(plan_text(plan, world, args.nodes, args.config))
    return 0
