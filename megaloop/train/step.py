"""One optimizer step (`train_step`): cut this rank's rows into micro-batches, forward/backward each with the loss
weighted by its true share of the global batch's tokens, launch ONE packed reduction of the step's statistics over
the whole job (which also carries the stop flag), reduce gradients, clip and step; then (`reduce_step`, called by the
loop) read the reduced statistics on the host.

The statistics are complete once the micro-batches have run, so their reduction is launched there, before the
gradient reduction (the same order on every rank), and copied to the host without waiting
(megaloop.model.transfer.HostCopy). On a GPU the step's one device sync is the optimizer's clip decision (the global
gradient norm read on the host): it drains the stream past that copy, so `reduce_step`'s read does not wait.

The micro-batch loop is the runtime's (runtime.run_micro_batches: a plain loop, or a pipeline schedule), handed the
step's micro-batches as megaloop.model.stages.StageMicroBatch and each one's loss scale. It never waits for the
device: depths and micro-batch sizes are host integers planned before it (`plan_step`), the global token count is
the host integer global_batch x seq (no collective), and the loss and telemetry stay device tensors, accumulated over
every micro-batch (loss x tokens, telemetry x rows) and read once, after the packed reduction (`reduce_step`).
"""
from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from megaloop.depth.balance import idle_fraction, split_rank_rows
from megaloop.model.stages import StageMicroBatch
from megaloop.model.transfer import HostCopy, to_device
from megaloop.train.flops import FlopModel
from megaloop.train.labels import next_token_labels
from megaloop.train.precision import autocast_for
from megaloop.train.protocols import TrainerRuntime
from megaloop.train.stopping import STOP_CODES, job_stop_code

# Telemetry averaged over the step's rows (each micro-batch's value weighted by its rows; under sequence parallelism a
# tensor-parallel rank's value is a mean over its positions, so the job-wide sum divided by tp averages them).
TELEMETRY = ("rho_A", "state_norm", "recurrent_residual")
# Host sums over this rank's rows. They and the loss, telemetry and core passes are identical on the tensor-parallel
# ranks of one dp rank (or, for telemetry, averaged over them), so the job-wide sums are divided by tp_size; the host
# sums and core passes are also counted by every pipeline stage (divided by pp_size too), while the loss and each
# telemetry value come from one stage (the others report zero).
HOST_SUMS = ("tokens", "sequences", "useful_flops", "executed_flops", "depth_sum")


@dataclass
class MicroBatch:
    """One micro-batch of this rank: indices into the rank's rows and its host depths (T, k)."""

    rows: np.ndarray
    depth: np.ndarray
    backprop_depth: np.ndarray


@dataclass
class StepStats:
    """A step's local statistics: host numbers and device tensors, packed by `pack` for the one reduction."""

    host: dict = field(default_factory=lambda: dict.fromkeys(HOST_SUMS, 0.0))
    loss_sum: torch.Tensor | float = 0.0  # sum over this rank's tokens of the token losses (device tensor)
    telemetry: dict = field(default_factory=dict)  # name -> sum over micro-batches of value x rows (device)
    core_rows: object = 0  # core passes executed on this rank (int, or a device tensor from the model)
    ran: list = field(default_factory=list)  # (micro-batch, the core passes the model reported for it)
    times: dict = field(default_factory=lambda: dict.fromkeys(TIMED, 0.0))
    times_step: int = 0  # the step `times` belong to: this one on the CPU, the previous one on a GPU (StepTimer)
    record: object = None
    summed: HostCopy | None = None  # the packed statistics summed over the job, on their way to the host


def plan_step(depth_sample, micro_batch_size: int, by_depth: bool) -> list[MicroBatch]:
    """This rank's rows cut into micro-batches of at most micro_batch_size (sorted by depth when by_depth)."""
    T, k = depth_sample.T.numpy(), depth_sample.k.numpy()
    return [MicroBatch(rows, T[rows], k[rows]) for rows in split_rank_rows(T, micro_batch_size, by_depth)]


# communication: the gradient reduction's exposed part (what reduce_gradients waits for after the backward);
# pipeline_idle: a pipeline stage's waits for its neighbours' messages (CPU; on a GPU the ring run is "forward")
TIMED = ("forward", "backward", "communication", "optimizer", "pipeline_idle")


class StepTimer:
    """forward/backward times summed over micro-batches, the gradient reduction, the optimizer. On the CPU (where
    work is synchronous): wall clock, read at the end of the step. On a GPU: CUDA events, read one step later, so
    that reading them never waits for the device (by then the step's skip decision has synchronised past them);
    one timer lives across the steps and `completed_totals()` at step s returns step s-1's times (NaN at a job's
    first): the latest step whose times are complete."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.lag = 1 if self.cuda else 0  # completed_totals() at step s: step s - lag's times
        self.spans = self._empty()
        self.pending = None  # CUDA: the previous step's spans, read at this step's end

    @staticmethod
    def _empty() -> dict:
        return {name: [] for name in TIMED}

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add(self, name: str, start, end) -> None:
        self.spans[name].append((start, end))

    def completed_totals(self) -> dict:
        """The latest complete step's times: this step's on the CPU, the previous step's on CUDA (read without
        waiting for the device); starts the next step's spans."""
        spans, self.spans = self.spans, self._empty()
        if not self.cuda:
            return {k: sum(b - a for a, b in v) for k, v in spans.items()}
        previous, self.pending = self.pending, spans
        if previous is None:
            return dict.fromkeys(spans, float("nan"))
        for _, end in (pair for v in previous.values() for pair in v):
            end.synchronize()  # recorded before this step's work: complete already, so this does not wait
        return {k: sum(a.elapsed_time(b) for a, b in v) / 1e3 for k, v in previous.items()}


def train_step(model, optimizer, batch: dict, depth_sample, step: int, seed: int, cfg, runtime: TrainerRuntime,
               flop_model: FlopModel, loop_guard=contextlib.nullcontext, timer: StepTimer | None = None,
               stop_code: Callable[[], int] = lambda: 0, veto: Callable[[StepStats, int], bool] | None = None
               ) -> StepStats:
    """batch: {"tokens": [rows, S+1], "sample_index": [rows]}: this data-parallel rank's rows (any number).
    `loop_guard()` is entered around the micro-batches' assembly and loop (tests count host syncs and blocking
    host-to-device copies inside it). `timer`: one StepTimer kept over the steps (on a GPU it reports the previous
    step's times; a fresh one per step reports NaN there). `stop_code()`: this rank's stop code (StopRequests),
    taken when the statistics are packed, after the micro-batches. `veto(stats, step)` (train.on_spike=skip): true
    drops the step's update (megaloop.train.spikes), judged on the packed statistics before the optimizer runs."""
    tokens, sample_index = batch["tokens"], batch["sample_index"]
    device, seq = runtime.device, tokens.shape[1] - 1
    global_tokens = cfg.data.global_batch_size * seq  # a host integer: the loss is the global token mean
    plan = plan_step(depth_sample, cfg.data.micro_batch_size, cfg.train.bucket_depths)
    stats, timer = StepStats(), timer or StepTimer(device)
    _count_host(stats, plan, depth_sample, flop_model, seq)
    scales = [len(mb.rows) * seq / global_tokens for mb in plan]  # each one's share of the global token mean
    autocast = functools.partial(autocast_for, cfg.train.precision, device)
    with loop_guard():
        micro_batches = _stage_micro_batches(tokens, sample_index, plan, device, (seed, step), batch.get("pad_id"))
        results = runtime.run_micro_batches(model, micro_batches, scales, autocast, timer)
        for mb, result in zip(plan, results):
            _accumulate(stats, result, mb, len(mb.rows) * seq)
    stats.summed = launch_stats(stats, runtime, flop_model, seq, stop_code())  # before the gradients, on every rank
    t2 = timer.mark()
    runtime.reduce_gradients(model)
    t3 = timer.mark()
    timer.add("communication", t2, t3)
    if veto is not None and veto(stats, step):  # every rank judges the same job-wide figures
        stats.record = optimizer.skip_step(step)
    else:
        stats.record = optimizer.step(step)
    optimizer.zero_grad(set_to_none=True)
    timer.add("optimizer", t3, timer.mark())
    stats.times.update(timer.completed_totals())  # on a GPU the previous step's: no synchronisation here
    stats.times_step = step - timer.lag
    return stats


def schedule_ahead(cfg, runtime: TrainerRuntime, model):
    """prepare(step, batch) for the loader's prefetch thread where the runtime schedules its micro-batches (a
    pipeline runtime's plan_ahead): step `step`'s micro-batches planned as train_step will plan them (same depths,
    same cut) and handed over on the host, so the ring schedule is made while the device runs earlier steps. None
    for other runtimes (runtime.plans_ahead false: their plan_ahead does nothing)."""
    if not runtime.plans_ahead:
        return None
    plan_ahead = runtime.plan_ahead
    from megaloop.depth import make_sampler

    m = cfg.model  # a sampler of the prefetch thread's own (depths are a pure function of seed, step and index)
    sampler = make_sampler(m.depth_sampler, m.mu_rec, m.backprop_depth, seed=cfg.train.seed)

    def prepare(step: int, batch: dict) -> None:
        plan = plan_step(sampler.sample(step, batch["sample_index"]), cfg.data.micro_batch_size,
                         cfg.train.bucket_depths)
        host = torch.device("cpu")
        plan_ahead(model, _stage_micro_batches(batch["tokens"], batch["sample_index"], plan, host,
                                               (cfg.train.seed, step)))

    return prepare


def _stage_micro_batches(tokens, sample_index, plan: list[MicroBatch], device, seed_step: tuple,
                         pad_id: int | None = None) -> list:
    """The micro-batches' rows as the model takes them (StageMicroBatch): inputs and next-token labels on `device`,
    host depths, and h_0's noise key (seed, step, the rows' global sample indices). The batch's tokens (pinned by
    the loader where the device is CUDA) and the micro-batches' row order each go to the device in one
    non-blocking copy; each micro-batch is a slice of the reordered rows."""
    if not plan:
        return []
    ids = to_device(tokens, device).index_select(0, to_device(np.concatenate([mb.rows for mb in plan]), device))
    out, start = [], 0
    for mb in plan:
        part, start = ids[start:start + len(mb.rows)], start + len(mb.rows)
        noise_key = (*seed_step, sample_index[torch.from_numpy(mb.rows)])
        labels = next_token_labels(part, pad_id)  # -100 where the target is padding (labels.py)
        out.append(StageMicroBatch(part[:, :-1], labels, mb.depth, mb.backprop_depth, noise_key))
    return out


def _count_host(stats: StepStats, plan: list[MicroBatch], depth_sample, flop_model: FlopModel, seq: int) -> None:
    """The host sums known before the loop: tokens, rows, depths and useful FLOPs."""
    h = stats.host
    h["tokens"] = float(len(depth_sample) * seq)
    h["sequences"] = float(len(depth_sample))
    h["depth_sum"] = float(depth_sample.T.sum())
    h["useful_flops"] = sum(flop_model.useful(depth_sample.select(mb.rows).n, depth_sample.select(mb.rows).k, seq)
                            for mb in plan)


def _accumulate(stats: StepStats, out, mb: MicroBatch, n_tok: int) -> None:
    """Add one micro-batch's loss and telemetry (a pipeline.micro_batches.MicroBatchResult) to the step's running
    sums (device tensors, no read-back)."""
    rows = len(mb.rows)
    stats.loss_sum = stats.loss_sum + out.loss.detach().to(torch.float64) * n_tok
    tel = out.telemetry
    for name in TELEMETRY:
        value = tel.get(name, float("nan"))
        value = value.detach().to(torch.float64) if torch.is_tensor(value) else float(value)
        stats.telemetry[name] = stats.telemetry.get(name, 0.0) + value * rows
    stats.core_rows = stats.core_rows + tel.get("core_rows", int(mb.depth.sum()))
    stats.ran.append((mb, tel.get("core_rows")))


@dataclass
class StepFigures:
    """A step's statistics over the whole job, from the packed reduction."""

    loss: float
    tokens: int
    sequences: int
    useful_flops: float
    executed_flops: float
    mean_depth: float
    executed_depth: float
    idle_fraction: float  # FLOP-weighted: 1 - useful FLOPs / (dp x the busiest dp rank's executed FLOPs)
    idle_fraction_loop: float  # the same over core passes only (the figure logged before FLOP weighting)
    telemetry: dict
    stop_code: int  # 0: go on; else the job's stop code (stopping.job_stop_code: a signal's, or the time limit's)


def pack(stats: StepStats, flop_model: FlopModel, seq: int, dp_rank: int, dp_size: int, stop_code: int,
         device) -> torch.Tensor:
    """[loss_sum, TELEMETRY..., core passes of dp rank 0..dp-1 (this rank's slot only), HOST_SUMS..., executed
    FLOPs of dp rank 0..dp-1 (this rank's slot only), ranks stopping by code 1, by code 2] as one float64 vector
    on `device`."""
    stats.host["executed_flops"] = _executed_flops(stats, flop_model, seq)
    zero = torch.zeros((), dtype=torch.float64, device=device)
    host = [stats.host[name] for name in HOST_SUMS]
    parts = [zero + stats.loss_sum, *(zero + stats.telemetry.get(name, float("nan")) for name in TELEMETRY)]
    slots = [zero] * dp_size
    slots[dp_rank] = zero + stats.core_rows
    flop_slots = [0.0] * dp_size
    flop_slots[dp_rank] = stats.host["executed_flops"]
    stops = [float(stop_code == code) for code in range(1, STOP_CODES + 1)]
    return torch.cat([torch.stack(parts + slots),
                      to_device(torch.tensor(host + flop_slots + stops, dtype=torch.float64), device)])


def _executed_flops(stats: StepStats, flop_model: FlopModel, seq: int) -> float:
    """FLOPs as run: a micro-batch whose core passes equal the sum of its depths (the ragged loop) ran its useful
    FLOPs; otherwise every row ran max(n) + max(k) laps (the masked loop)."""
    total = 0.0
    for mb, core_rows in stats.ran:
        k, n = torch.from_numpy(mb.backprop_depth), torch.from_numpy(mb.depth - mb.backprop_depth)
        ragged = isinstance(core_rows, int) and core_rows == int(mb.depth.sum())
        total += flop_model.useful(n, k, seq) if ragged else flop_model.executed(n, k, seq)
    return total


def launch_stats(stats: StepStats, runtime: TrainerRuntime, flop_model: FlopModel, seq: int,
                 stop_code: int) -> HostCopy:
    """The step's statistics packed and summed over the job in runtime.sum_stats (one collective), on their way to
    the host (read by reduce_step)."""
    vec = pack(stats, flop_model, seq, runtime.dp_rank, runtime.dp_size, stop_code, runtime.device)
    return HostCopy(runtime.sum_stats(vec))


def reduce_step(stats: StepStats, runtime: TrainerRuntime) -> StepFigures:
    """The step's statistics summed over the job (launched by train_step), as figures. On a GPU their copy to the
    host has completed by now (the clip decision synchronised the stream past it): this read does not wait."""
    dp, tp, copies = runtime.dp_size, runtime.tp_size, runtime.tp_size * runtime.pp_size
    total = stats.summed.tolist()
    n_tel = len(TELEMETRY)
    # the loss and telemetry come from one pipeline stage each (zero on the others), the host sums and core passes
    # from every stage of a dp rank alike
    loss_sum, tel = total[0] / tp, [v / tp for v in total[1:1 + n_tel]]
    rank_core_rows = [v / copies for v in total[1 + n_tel:1 + n_tel + dp]]
    host = dict(zip(HOST_SUMS, [v / copies for v in total[1 + n_tel + dp:1 + n_tel + dp + len(HOST_SUMS)]]))
    rank_flops = [v / copies for v in total[1 + n_tel + dp + len(HOST_SUMS):-STOP_CODES]]
    stops = total[-STOP_CODES:]
    tokens, sequences = int(round(host["tokens"])), max(int(round(host["sequences"])), 1)
    return StepFigures(
        loss=loss_sum / max(tokens, 1), tokens=tokens, sequences=sequences, useful_flops=host["useful_flops"],
        executed_flops=host["executed_flops"], mean_depth=host["depth_sum"] / sequences,
        executed_depth=sum(rank_core_rows) / sequences,
        idle_fraction=idle_fraction(host["useful_flops"], rank_flops),
        idle_fraction_loop=idle_fraction(host["depth_sum"], rank_core_rows),
        telemetry={name: v / sequences for name, v in zip(TELEMETRY, tel)},
        stop_code=job_stop_code(stops))
