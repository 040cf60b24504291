"""The time planner: one optimizer step's predicted time on the busiest rank, and what it makes of a token budget.

  compute     the FLOP model (megaloop/train/flops.py, full attention convention) of data-parallel rank 0's
              micro-batches at step 0 as the trainer deals them (the planner's `micro_batch_specs`): per micro-batch
              rows x seq_len tokens of non-loop work, every lap at its active fraction (ragged loop), forward only
              for the first laps - k and forward + backward for the last k; activation checkpointing (block or lap)
              runs the kept laps' forward once more. Split over tp, run at `Device.rate`: the dense peak of the
              compute dtype times the stated efficiency (an MFU-like factor).
  optimizer   Polar Express on the Muon matrices of the most loaded owner (ns_steps x (4 m^2 n + 2 m^3) per m x n
              matrix, m <= n) at the peak of its dtype (bf16 where native, as megaloop.train.precision.orth_dtype)
              times the same efficiency; under tp, each split matrix's gradient gathered to its owner and its
              update scattered back (two all-gathers' time each, the dp slices' groups side by side); AdamW's
              elementwise work is not counted.
  tp          per block run (forward, backward, recomputation): two all-gathers and two reduce-scatters of the
              micro-batch's [rows, s, d] stream under sequence parallelism, else two all-reduces, scaled by the
              lap's active fraction; the embedding and head add two (SP) or one of each direction, the
              vocabulary-parallel loss three all-reduces of [rows, s] fp32. All exposed (on the compute stream).
  pp          the ring pipeline simulator (pipeline/ring/simulate.py) run three times on one schedule, in seconds:
              compute only, + tp, + the point-to-point messages ([rows, s, d] of the message dtype, / tp under SP,
              over the link between neighbouring stages); the makespan of the last is the pipeline's step, the
              differences are the exposed tp and pp communication.
  dp          the buckets the trainer builds (megaloop/plan/dp_buckets.py: the gradient buffer's groups and
              column ranges, parallel.grad_buckets, parallel.grad_bucket_elements or the scheme's default), a
              reduce-scatter (bf16 reduction: the all-to-all the reducer runs) + all-gather per bucket under ZeRO-1,
              all-reduce without, in the wire dtype (megaloop/plan/comm.py). Exposed: the reduction beyond the last
              micro-batch's backward, each bucket on the wire from when its last gradient is final; the all-gather's
              waits in the first micro-batch's forward (overlap_param_gather), else all of it. The ring pipeline
              reduces after its run: no overlap under pp > 1.

step = compute (or the pipeline's makespan) + tp + optimizer + exposed dp; exposed_comm_fraction = (tp + pp + exposed
dp) / step. Not modelled: kernel launch gaps, elementwise and memory-bound work beyond what the efficiency absorbs,
load imbalance between data-parallel ranks (rank 0's micro-batches stand for all), stragglers.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from megaloop.config import ConfigError
from megaloop.plan.comm import Cluster, DpComm, DpTraffic, Link, collective_time, dp_traffic
from megaloop.plan.dp_buckets import planned_buckets
from megaloop.plan.layout import LocalParam
from megaloop.plan.pipeline import _forward_flops, core_ranges, micro_batch_specs, stage_params
from megaloop.plan.planner import Plan
from megaloop.train.flops import FlopModel, fp8_shares
from pipeline.data_parallel import MAX_IN_FLIGHT
from pipeline.dist_muon import assign_owners
from pipeline.ring import CostModel, MicroBatch, ring_schedule, simulate

SECONDS_PER_DAY = 86400.0
DEFAULT_EFFICIENCY = 0.4


@dataclass(frozen=True)
class Device:
    """One accelerator for the time model: its dense peak in TFLOP/s in the compute dtype, and the fraction of it
    the model's FLOPs are assumed to run at."""

    name: str
    peak_tflops: float
    efficiency: float = DEFAULT_EFFICIENCY
    optimizer_tflops: float | None = None  # the peak of Muon's Polar Express dtype (bf16 where native); None: peak
    fp8_tflops: float | None = None  # the dense FP8 peak, for the GEMMs train.fp8 runs in FP8; None: FP8 off

    def __post_init__(self):
        if not self.peak_tflops > 0:
            raise ConfigError("--peak-tflops", self.peak_tflops, "must be > 0 TFLOP/s")
        if not 0 < self.efficiency <= 1:
            raise ConfigError("--mfu", self.efficiency, "must be in (0, 1]: the fraction of the dense peak reached")

    @property
    def rate(self) -> float:
        """FLOP/s the model's work runs at."""
        return self.peak_tflops * 1e12 * self.efficiency

    @property
    def optimizer_rate(self) -> float:
        """FLOP/s of the Polar Express iteration (its own dtype's peak at the same efficiency)."""
        return (self.optimizer_tflops or self.peak_tflops) * 1e12 * self.efficiency

    def time_factor(self, fp8_share: float) -> float:
        """Seconds of work with `fp8_share` of its FLOPs in FP8 GEMMs over the same work at `rate`: the FP8 part
        runs at the FP8 peak times the same efficiency."""
        if not self.fp8_tflops or not fp8_share:
            return 1.0
        return 1.0 - fp8_share + fp8_share * self.peak_tflops / self.fp8_tflops


@dataclass(frozen=True)
class TimePlan:
    """One step on the busiest rank, in seconds, and the throughput it gives."""

    compute_s: float  # model FLOPs (pp > 1: the simulated makespan without communication, bubbles included)
    optimizer_s: float
    tp_s: float  # exposed tensor-parallel collectives
    pp_s: float  # exposed point-to-point messages
    dp: DpTraffic
    dp_exposed_s: float
    tokens_per_step: int
    pipeline_idle: float = 0.0  # the simulated idle fraction with communication (pp > 1)
    busiest_s: float | None = None  # pp > 1: the busiest stage's compute alone (no bubbles); None: compute_s

    @property
    def busy_s(self) -> float:
        """Seconds the busiest rank computes (model and optimizer), without waits of any kind."""
        return (self.compute_s if self.busiest_s is None else self.busiest_s) + self.optimizer_s

    @property
    def exposed_comm_s(self) -> float:
        return self.tp_s + self.pp_s + self.dp_exposed_s

    @property
    def step_time_s(self) -> float:
        return self.compute_s + self.optimizer_s + self.exposed_comm_s

    @property
    def exposed_comm_fraction(self) -> float:
        return self.exposed_comm_s / self.step_time_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_time_s

    @property
    def tokens_per_day(self) -> float:
        return self.tokens_per_s * SECONDS_PER_DAY

    def days(self, tokens: float) -> float:
        return tokens / self.tokens_per_day


@dataclass(frozen=True)
class _Work:
    """Seconds of one micro-batch on one rank: compute forward / backward and exposed tp communication."""

    forward: float
    backward: float
    tp: float


class _Rank:
    """What one rank runs per micro-batch, from the config, the layout, the device and the cluster."""

    def __init__(self, plan: Plan, device: Device, cluster: Cluster):
        cfg, lay = plan.cfg, plan.layout
        self.cfg, self.m, self.lay, self.device = cfg, cfg.model, lay, device
        self.flops = FlopModel.of(cfg.model)
        self.rows = cfg.data.global_batch_size // lay.dp
        self.act = 8 if cfg.train.precision == "fp64" else 4
        self.mm = 2 if cfg.train.precision == "bf16" else self.act
        self.recompute = cfg.train.activation_checkpointing != "none"
        self.tp_link = cluster.group_link(lay.tp, 1)
        fp8 = getattr(cfg.train, "fp8", "none") != "none"
        lap, ends = fp8_shares(cfg.model, getattr(cfg.train, "fp8_prelude_coda", False)) if fp8 else (0.0, 0.0)
        self.lap_factor, self.ends_factor = device.time_factor(lap), device.time_factor(ends)

    def micro_rows(self, n_micro: int) -> float:
        return self.rows / n_micro

    def tokens(self, rows: float) -> float:
        return rows * self.m.seq_len

    def block_comm(self, rows: float, frac: float = 1.0) -> float:
        """Tensor-parallel collectives of one block run (forward or backward) over `frac` of `rows`."""
        tp = self.lay.tp
        if tp == 1:
            return 0.0
        x = rows * self.m.seq_len * self.m.d_model * frac
        if self.lay.sp:
            return 2 * (collective_time("all_gather", tp, x * self.act, self.tp_link)
                        + collective_time("reduce_scatter", tp, x * self.mm, self.tp_link))
        return 2 * collective_time("all_reduce", tp, x * self.mm, self.tp_link)

    def ends_comm(self, rows: float) -> tuple[float, float]:
        """(embedding, head + loss) tensor-parallel collectives of one micro-batch, forward and backward."""
        tp = self.lay.tp
        if tp == 1:
            return 0.0, 0.0
        x = rows * self.m.seq_len * self.m.d_model
        one = 2 * self.block_comm(rows) / 4 if self.lay.sp else collective_time("all_reduce", tp, x * self.mm,
                                                                                 self.tp_link)
        loss = collective_time("all_reduce", tp, rows * self.m.seq_len * 4, self.tp_link, calls=3)
        return one, one + loss

    def micro_batch(self, spec: MicroBatch, rows: float) -> _Work:
        """Compute and tp seconds of one micro-batch of `rows` rows (pp = 1)."""
        f, m = self.flops, self.m
        tokens, rate, tp = self.tokens(rows), self.device.rate, self.lay.tp
        grad_from = spec.laps - spec.grad_laps
        fracs = [spec.active_fraction(lap) for lap in range(spec.laps)]
        grad = sum(fracs[grad_from:]) if m.is_looped else 0.0
        every = sum(fracs) if m.is_looped else 0.0
        nl, lf = f.non_loop * self.ends_factor, self.lap_factor
        fwd = nl / 3 + every * f.step_nograd * lf
        bwd = 2 * nl / 3 + lf * (grad * (f.step_grad - f.step_nograd) + (grad * f.step_nograd if self.recompute
                                                                         else 0.0))
        ends = (m.n_prelude + m.n_coda) if m.is_looped else m.n_layers
        core_f = sum(self.block_comm(rows, fr) for fr in fracs) * m.n_core if m.is_looped else 0.0
        core_b = sum(self.block_comm(rows, fr) for fr in fracs[grad_from:]) * m.n_core if m.is_looped else 0.0
        tp_comm = 2 * ends * self.block_comm(rows) + core_f + core_b * (2 if self.recompute else 1)
        tp_comm += sum(self.ends_comm(rows))
        return _Work(tokens * fwd / tp / rate, tokens * bwd / tp / rate, tp_comm)


def optimizer_seconds(params: list[LocalParam], plan: Plan, rate: float, tp_link: Link | None = None) -> float:
    """Polar Express on the most loaded Muon owner, plus, under tp, the gather of each split matrix's gradient to
    its owner and the scatter of its update (see the module docstring)."""
    lay, ns = plan.layout, getattr(plan.cfg.optim, "ns_steps", 5)
    muon = [p for p in params if p.optimizer == "muon" and len(p.full_shape) == 2]
    if not muon:
        return 0.0
    matrices = [p.full_shape for p in muon]
    sharded = lay.zero_stage >= 1 and lay.dp > 1
    slots = (lay.dp if sharded else 1) * lay.tp if (lay.tp > 1 or sharded) else 1
    cost = [ns * (4 * min(s) ** 2 * max(s) + 2 * min(s) ** 3) for s in matrices]
    load = [0.0] * slots
    for c, slot in zip(cost, assign_owners([s[0] * s[1] for s in matrices], slots)):
        load[slot] += c
    comm = 0.0
    if lay.tp > 1 and tp_link is not None:  # one tp group's calls run in turn; the dp slices' groups side by side
        grad_bytes = 8 if plan.cfg.train.precision == "fp64" else 4
        split = [p.full_numel * grad_bytes for p in muon if p.local_shape != p.full_shape]
        comm = 2 * sum(collective_time("all_gather", lay.tp, x, tp_link) for x in split) / (lay.dp if sharded else 1)
    return max(load) / rate + comm


def _dp(plan: Plan, params: list[LocalParam], cluster: Cluster, comm: DpComm, backward_s: float,
        forward_s: float) -> DpTraffic:
    """The rank's data-parallel traffic over the buckets the trainer builds (see the module docstring)."""
    lay, cfg = plan.layout, plan.cfg
    grad_bytes = 8 if cfg.train.precision == "fp64" else 4
    bf16 = cfg.parallel.grad_reduce_dtype == "bf16"
    wire = 2 if bf16 else grad_bytes
    sharded = lay.zero_stage >= 1 and lay.dp > 1
    elements = cfg.parallel.grad_bucket_elements or comm.bucket_elements(lay.dp, grad_bytes)
    buckets = planned_buckets(params, lay.dp, lay.tp, sharded, elements, cfg.parallel.grad_buckets,
                              cfg.model.mu_rec, cfg.model.backprop_depth)
    link = cluster.group_link(lay.dp, lay.tp)
    return dp_traffic(buckets, lay.dp, link, wire, sharded, bf16, backward_s, forward_s,
                      comm.overlap_param_gather and cfg.parallel.overlap_param_gather, MAX_IN_FLIGHT)


def time_plan(plan: Plan, device: Device, cluster: Cluster, comm: DpComm) -> TimePlan:
    """The predicted step of `plan` on `device`s of `cluster` with the data-parallel scheme `comm`."""
    if plan.layout.pp > 1:
        return _pipeline_time(plan, device, cluster, comm)
    rank = _Rank(plan, device, cluster)
    specs = micro_batch_specs(plan.cfg, plan.layout.dp)
    rows = rank.micro_rows(len(specs))
    work = [rank.micro_batch(s, rows) for s in specs]
    compute = sum(w.forward + w.backward for w in work)
    tp = sum(w.tp for w in work)
    params = list(plan.params)
    dp = _dp(plan, params, cluster, comm, work[-1].backward, work[0].forward)
    exposed = dp.exposed_s
    tokens = plan.cfg.data.global_batch_size * plan.cfg.model.seq_len
    optimizer = optimizer_seconds(params, plan, device.optimizer_rate, rank.tp_link)
    return TimePlan(compute, optimizer, tp, 0.0, dp, exposed, tokens)


def _pipeline_time(plan: Plan, device: Device, cluster: Cluster, comm: DpComm) -> TimePlan:
    cfg, lay, pipe = plan.cfg, plan.layout, plan.pipeline
    rank, m = _Rank(plan, device, cluster), cfg.model
    specs = list(pipe.specs)
    rows = rank.micro_rows(len(specs))
    params = list(plan.params)
    ranges = core_ranges(cfg, lay.pp)
    largest = max(_forward_flops(params, tuple(f"core.{j}." for j in range(a, b)) + (("injection.",) if s == 0 else ()),
                                 b - a, cfg) for s, (a, b) in enumerate(ranges))  # as pipeline.stage_costs
    unit = rank.tokens(rows) * largest / lay.tp / device.rate  # one forward lap segment of the largest stage
    c = pipe.costs
    back = c.backward + (c.forward if rank.recompute else 0.0)
    lap, ends = unit * rank.lap_factor, unit * rank.ends_factor  # FP8 GEMMs (train.fp8) at the FP8 peak
    compute = CostModel(forward=lap, backward=back * lap, nograd_forward=lap, embed=c.embed * ends,
                        embed_backward=c.embed_backward * ends, loss=c.loss * ends,
                        loss_backward=c.loss_backward * ends)
    blocks = max(b - a for a, b in ranges)
    blk = rank.block_comm(rows)
    emb, head = rank.ends_comm(rows)
    with_tp = replace(compute, forward=lap + blocks * blk, nograd_forward=lap + blocks * blk,
                      backward=compute.backward + blocks * blk * (2 if rank.recompute else 1),
                      embed=compute.embed + m.n_prelude * blk + emb / 2,
                      embed_backward=compute.embed_backward + m.n_prelude * blk + emb / 2,
                      loss=compute.loss + m.n_coda * blk + head / 2,
                      loss_backward=compute.loss_backward + m.n_coda * blk + head / 2)
    msg_dtype = getattr(cfg.parallel, "pp_message_dtype", None)
    msg_bytes = {"bf16": 2, "fp32": 4}.get(msg_dtype, rank.act)
    message = rows * m.seq_len * m.d_model * msg_bytes / (lay.tp if lay.sp else 1)
    link = _pp_link(cluster, lay)
    with_msg = replace(with_tp, latency=link.latency, latency_per_byte=1 / link.bandwidth, message_bytes=message)
    bound = pipe.max_in_flight
    schedule = ring_schedule(specs, lay.pp, bound, 2 * bound, c)
    spans = [simulate(schedule, specs, costs, bound, 2 * bound) for costs in (compute, with_tp, with_msg)]
    stages = stage_params(params, cfg, lay.pp)
    busiest = max(stages, key=lambda st: sum(p.local_numel for p in st))
    dp = _dp(plan, list(busiest), cluster, comm, 0.0, 0.0)  # the ring pipeline reduces after its run
    exposed = dp.exposed_s
    optimizer = max(optimizer_seconds(st, plan, device.optimizer_rate, rank.tp_link) for st in stages)
    tokens = cfg.data.global_batch_size * m.seq_len
    c0, c1, c2 = (s.makespan for s in spans)
    return TimePlan(c0, optimizer, c1 - c0, c2 - c1, dp, exposed, tokens, spans[2].idle_fraction,
                    max(spans[0].busy))


def _pp_link(cluster: Cluster, lay) -> Link:
    """Neighbouring stages are tp x dp ranks apart; the ring's slowest hop sets the pace."""
    stride = lay.tp * lay.dp
    return cluster.group_link(lay.pp, stride)


GPU_PEAK_NAMES = {"h100": "H100", "h200": "H200", "a100": "A100"}  # megaloop.train.peak.PEAK_TFLOPS's keys


def device_for(name: str, precision: str, efficiency: float = DEFAULT_EFFICIENCY,
               peak_tflops: float | None = None, fp8: bool = False) -> Device:
    """The time model's device: a GPU's dense peak from megaloop.train.peak's table, or "cpu": this machine's
    matmul peak as `python -m megaloop peak` caches it (measured now when missing); `peak_tflops` overrides. fp8
    (train.fp8 on): also the FP8 peak (the table's, or this CPU's torch._scaled_mm rate), scaled like the peak when
    `peak_tflops` overrides it."""
    device = _device_for(name, precision, efficiency, peak_tflops)
    if not fp8:
        return device
    from megaloop.train.peak import PEAK_TFLOPS, cpu_peak

    if name == "cpu":
        fp8_peak = cpu_peak("fp8").tflops
        base = cpu_peak(precision).tflops
    else:
        gpu = GPU_PEAK_NAMES.get(name, name)
        fp8_peak, base = PEAK_TFLOPS.get((gpu, "fp8")), PEAK_TFLOPS.get((gpu, precision))
        if fp8_peak is None:
            raise ConfigError("train.fp8", "on", f"no FP8 peak known for {gpu} (no FP8 tensor cores in the table): "
                              "plan with train.fp8=none")
    if peak_tflops is not None and base:  # the same ratio to the stated peak
        fp8_peak = fp8_peak * peak_tflops / base
    return replace(device, fp8_tflops=fp8_peak)


def _device_for(name: str, precision: str, efficiency: float, peak_tflops: float | None) -> Device:
    from megaloop.train.peak import PEAK_TFLOPS, cpu_peak

    if name == "cpu":
        import torch

        from megaloop.train.hardware import bf16_support

        orth = "bf16" if precision != "fp64" and bf16_support(torch.device("cpu")).native else precision
        peak = peak_tflops if peak_tflops is not None else cpu_peak(precision).tflops
        return Device("CPU", peak, efficiency, cpu_peak(orth).tflops if orth != precision else None)
    gpu = GPU_PEAK_NAMES.get(name, name)
    orth = PEAK_TFLOPS.get((gpu, "bf16")) if precision != "fp64" else None
    if peak_tflops is not None:
        return Device(gpu, peak_tflops, efficiency, orth)
    if (gpu, precision) not in PEAK_TFLOPS:
        raise ConfigError("--gpu", name, f"no dense {precision} peak known for it: pass --peak-tflops, or plan "
                          "with train.precision=bf16")
    return Device(gpu, PEAK_TFLOPS[(gpu, precision)], efficiency, orth)
