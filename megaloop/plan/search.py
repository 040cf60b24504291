"""Time and memory of one layout (`estimate`), and the layouts of a job ranked by predicted step time (`search`).

An estimate is the memory plan (megaloop/plan/planner.py) and the time plan (megaloop/plan/time_model.py) of one
config at its micro-batch size and activation checkpointing; its peak is the most loaded rank's (under pp > 1 the
largest stage's parameters, gradients, optimizer state and stored activations).

The search varies tp (dividing the GPUs per node), pp (dividing the core blocks' count and the world),
dp = world / (tp pp), the micro-batch (powers of two dividing the rows per dp rank), activation checkpointing and
parallel.grad_reduce_dtype; a layout the config rejects is skipped, and so is one whose peak does not fit the
GPU. For each (tp, pp, micro-batch, grad_reduce_dtype) only the first checkpointing setting that fits is kept, in
the order none, block, lap: none recomputes nothing, and block and lap recompute the same FLOPs, lap storing less.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megaloop.config import Config, ConfigError, load_config
from megaloop.model import build_model, count_parameters
from megaloop.plan.activations import CHECKPOINTING
from megaloop.plan.comm import Cluster, DpComm
from megaloop.plan.gpus import GIB, Gpu
from megaloop.plan.run_length import RunLength
from megaloop.plan.layout import local_params, resolve_layout
from megaloop.plan.pipeline import pipeline_plan
from megaloop.plan.planner import Plan
from megaloop.plan.time_model import Device, TimePlan, time_plan

JSON_KEYS = ("step_time_s", "tokens_per_s", "days", "gpu_hours", "run", "exposed_comm_fraction", "peak_gib", "layout")


@dataclass(frozen=True)
class Estimate:
    plan: Plan
    time: TimePlan
    peak_bytes: int

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.plan.gpu.usable_bytes

    def layout(self) -> dict:
        cfg, lay = self.plan.cfg, self.plan.layout
        return {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "micro_batch": cfg.data.micro_batch_size,
                "activation_checkpointing": cfg.train.activation_checkpointing,
                "grad_reduce_dtype": cfg.parallel.grad_reduce_dtype, "sequence_parallel": lay.sp}

    def as_dict(self, run: RunLength) -> dict:
        """The JSON keys (`JSON_KEYS`), the step's breakdown under "time" and the whole run under "run"."""
        t, gpus = self.time, self.plan.layout.world
        return {"step_time_s": t.step_time_s, "tokens_per_s": t.tokens_per_s, "days": run.days(t.step_time_s),
                "gpu_hours": run.gpu_hours(t.step_time_s, gpus), "run": run.as_dict(t.step_time_s, gpus),
                "exposed_comm_fraction": t.exposed_comm_fraction,
                "peak_gib": self.peak_bytes / GIB, "layout": self.layout(),
                "time": {"compute_s": t.compute_s, "optimizer_s": t.optimizer_s, "tp_exposed_s": t.tp_s,
                         "pp_exposed_s": t.pp_s, "dp_reduce_s": t.dp.reduce_s, "dp_gather_s": t.dp.gather_s,
                         "dp_calls": t.dp.calls, "dp_exposed_s": t.dp_exposed_s,
                         "dp_reduce_exposed_s": t.dp.reduce_exposed_s, "dp_gather_exposed_s": t.dp.gather_exposed_s,
                         "tokens_per_step": t.tokens_per_step, "tokens_per_day": t.tokens_per_day,
                         "pipeline_idle_fraction": t.pipeline_idle, "fits": self.fits}}


def peak_bytes(plan: Plan) -> int:
    """The most loaded rank's peak at the config's micro-batch and checkpointing."""
    if plan.pipeline is not None:
        return max(st.total for st in plan.pipeline.stages)
    return plan.at(plan.cfg.data.micro_batch_size).peak


class Planner:
    """Plans of one job's variants, with the meta-device model built once per tp."""

    def __init__(self, gpu: Gpu, world: int, device: Device, cluster: Cluster, comm: DpComm, in_flight: int | None):
        self.gpu, self.world, self.device, self.cluster, self.comm = gpu, world, device, cluster, comm
        self.in_flight = in_flight
        self._params: dict[int, tuple] = {}
        self._n_params: int | None = None

    def plan(self, cfg: Config) -> Plan:
        if cfg.train.precision == "auto":
            cfg = cfg.with_precision("bf16")
        layout = resolve_layout(cfg, self.world)
        if self._n_params is None:
            self._n_params = count_parameters(build_model(cfg.model, device="meta"))
        if layout.tp not in self._params:
            self._params[layout.tp] = tuple(local_params(cfg, layout.tp))
        params = self._params[layout.tp]
        in_flight = self.in_flight or cfg.parallel.pp_in_flight
        pipe = pipeline_plan(cfg, layout, list(params), in_flight) if layout.pp > 1 else None
        return Plan(cfg, layout, self.gpu, self._n_params, params, pipe)

    def estimate(self, cfg: Config) -> Estimate:
        plan = self.plan(cfg)
        return Estimate(plan, time_plan(plan, self.device, self.cluster, self.comm), peak_bytes(plan))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _powers_of_two_dividing(n: int) -> list[int]:
    return [1 << k for k in range(n.bit_length()) if n % (1 << k) == 0]


def candidates(cfg: Config, world: int, gpus_per_node: int):
    """(tp, pp, micro_batch) of the search space before the config checks them."""
    for tp in _divisors(min(gpus_per_node, world)):
        for pp in _divisors(world // tp):
            if pp > max(1, cfg.model.n_core) or (world // tp) % pp:
                continue
            dp = world // (tp * pp)
            if cfg.data.global_batch_size % dp:
                continue
            for mb in _powers_of_two_dividing(cfg.data.global_batch_size // dp):
                yield tp, pp, mb


def search(config: str | Path, overrides: list[str], planner: Planner, gpus_per_node: int) -> list[Estimate]:
    """Every layout that fits, fastest first (see the module docstring)."""
    base = load_config(config, overrides, validate=False)
    found = []
    for tp, pp, mb in candidates(base, planner.world, gpus_per_node):
        for wire in ("fp32", "bf16"):
            for ck in CHECKPOINTING:
                sets = [f"parallel.tp={tp}", f"parallel.pp={pp}", "parallel.dp=null", f"data.micro_batch_size={mb}",
                        f"train.activation_checkpointing={ck}", f"parallel.grad_reduce_dtype={wire}"]
                try:
                    cfg = load_config(config, list(overrides) + sets, world_size=planner.world)
                    plan = planner.plan(cfg)
                except ConfigError:
                    break  # the layout itself is refused: no checkpointing setting helps
                peak = peak_bytes(plan)
                if peak <= planner.gpu.usable_bytes:
                    found.append(Estimate(plan, time_plan(plan, planner.device, planner.cluster, planner.comm),
                                          peak))
                    break
    return sorted(found, key=lambda e: e.time.step_time_s)
