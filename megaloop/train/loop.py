"""The training loop: build everything from one validated config, run the steps, log, validate, stop cleanly."""
from __future__ import annotations

import functools
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megaloop.config import Config
from megaloop.config.budget import budget_line, run_record, tokens_per_step
from megaloop.depth import make_sampler
from megaloop.model import build_model, count_parameters
from megaloop.optim import build_optimizer
from megaloop.train.build import InitSplit, empty_parameters, held_parameters
from megaloop.train.data import open_data
from megaloop.train.faults import Faults
from megaloop.train.heartbeat import Heartbeat
from megaloop.train.evaluate import default_val_depths, final_val_depths, validation_losses
from megaloop.train.flops import FlopModel
from megaloop.train.hardware import bf16_support
from megaloop.model.attention import kernel_calls, reset_kernel_calls, resolve_attention_backend
from megaloop.train.fp8 import with_fp8
from megaloop.train.peak import (PeakGuard, core_share, cpu_peak, local_processes,
                                  oversubscription_warning)
from megaloop.train.precision import PrecisionChoice, apply_optimizer_precision, param_dtype, resolve_precision
from megaloop.train.metrics import MetricsWriter
from megaloop.train.progress import Progress
from megaloop.train.restarts import record_restarts
from megaloop.train.protocols import DataSource, TrainerRuntime
from megaloop.train.runtime import set_phase_timeout
from megaloop.train.cadence import Cadence
from megaloop.train.spikes import SkipWindows, SpikeMonitor, stop_message
from megaloop.train.step import StepTimer, reduce_step, schedule_ahead, train_step
from megaloop.train.stopping import SAVE_DUE_CODE, StartupStop, StopRequests, deadline_from
from megaloop.train.wandb_log import open_wandb


@dataclass
class RunSummary:
    steps_done: int = 0  # the run's step count (resumed steps included)
    start_step: int = 0  # where this job started (a resumed run's checkpoint step)
    resumed_from: str | None = None
    stop_reason: str | None = None
    tokens: int = 0  # the run's tokens (resumed ones included), the same span as steps_done
    job_tokens: int = 0  # tokens trained by this job (what tokens_per_s divides by train_time_s)
    skipped: int = 0
    interrupted: bool = False
    data_wait_s: float = 0.0  # time the steps waited for their batch (time_data summed; the rank's own)
    data_bytes_downloaded: int = 0  # shard bytes this rank's node cache downloaded (streamed shards)
    data_cache_hit_ratio: float = 1.0  # shard requests served by the node cache without a download
    data_shards_skipped: int = 0  # shards left out under data.on_corrupt=skip
    train_time_s: float = 0.0
    useful_flops: float = 0.0
    executed_flops: float = 0.0
    peak_tflops: float = float("nan")
    peak_source: str = ""
    peak_unreliable_steps: int = 0  # steps that ran faster than the peak (MFU not reported for them)
    precision: str = ""
    precision_why: str = ""
    attention: str = ""  # the attention kernel, as resolved at build (model.attention)
    attention_calls: dict = field(default_factory=dict)  # kernel -> calls that ran it in this job's first step
    attention_fallbacks: dict = field(default_factory=dict)  # why auto's kernel could not take a call -> calls
    n_params: int = 0
    gpu_max_allocated: int = 0  # this rank's CUDA allocator peaks over the job, bytes (0 off a GPU)
    gpu_max_reserved: int = 0
    is_main: bool = True
    val: dict = field(default_factory=dict)
    losses: list = field(default_factory=list)
    nothing_to_do: bool = False  # the run was already at train.steps: this job trained nothing (rerun.py)
    epoch: int = 0  # the epoch of the last step's samples (0-based)
    rollbacks: list = field(default_factory=list)  # train.on_spike=rollback's "rollback" records in this job
    spike_stop: bool = False  # stopped for a loss spike: nothing saved after it, not to be requeued
    restarts: list = field(default_factory=list)  # the run's "restart" records so far (megaloop.train.restarts)
    run: dict = field(default_factory=dict)  # the run's length: steps, tokens per step, train.tokens as given

    @property
    def tokens_per_s(self) -> float:
        return self.job_tokens / self.train_time_s if self.train_time_s else 0.0

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["tokens_per_s"] = self.tokens_per_s
        d["val"] = {str(k): v for k, v in self.val.items()}
        return d


TEARDOWN_AFTER_ERROR_S = 5.0  # the process groups' last barrier, after an error (see close_runtime)


class TrainingDiverged(RuntimeError):
    """Too many steps in a row had a non-finite gradient norm (nothing was learned in them)."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no CUDA device is available; use train.device=cpu or auto")
    return torch.device(name)


def train(cfg: Config, runtime: TrainerRuntime | None = None) -> RunSummary:
    """Run (or continue) cfg.train.steps optimizer steps. All outputs go under cfg.train.out_dir. A stop signal
    before the first step raises StartupStop (rank 0 leaves a STOPPED marker); see megaloop.train.stopping."""
    from megaloop.train.checkpointing import mark_startup_stop

    try:
        return _train(cfg, runtime)
    except StartupStop as stop:
        if _is_main(runtime):
            mark_startup_stop(cfg, stop.signal_name)
        raise


def _is_main(runtime: TrainerRuntime | None) -> bool:
    """Rank 0 (before the runtime exists: from the launcher's environment, as pipeline.layout reads it)."""
    if runtime is not None:
        return runtime.is_main
    env = os.environ
    for var in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"):
        if var in env:
            return env[var] == "0"
    return True


def _train(cfg: Config, runtime: TrainerRuntime | None) -> RunSummary:
    from megaloop.train.checkpointing import RunCheckpoints
    from megaloop.train.rerun import recorded_summary
    from megaloop.train.runtime import make_runtime

    with StopRequests(starting=True) as flag:  # from here a signal ends the start-up at once (exit 75)
        device = resolve_device(cfg.train.device)
        choice = choose_precision(cfg, device)
        cfg = cfg.with_precision(choice.precision)  # from here on the run's precision is concrete, never "auto"
        owns_runtime = runtime is None
        runtime = runtime or make_runtime(cfg, device)
        out_dir = Path(cfg.train.out_dir)
        faults = Faults(runtime.rank, out_dir)  # MEGALOOP_FAULTS (tests and drills only)
        faults.at_start()
        data = open_data(cfg, runtime.dp_rank, runtime.dp_size, runtime.layout, device,  # fails early on bad data
                         gather=runtime.all_gather_object)
        ckpt = RunCheckpoints(cfg, runtime)
        idle = False
        try:  # a resumed job allocates its parameters without initialising them: the checkpoint fills them
            model, optimizer = build_model_and_optimizer(cfg, runtime, device, choice.native_bf16,
                                                         init=not ckpt.loads_weights())
            data.prepare_ahead(schedule_ahead(cfg, runtime, model))  # a ring schedule made in the prefetch thread
            start = ckpt.restore(model, optimizer, data)
            idle = start >= cfg.train.steps  # nothing to do: the run's files stay as they are
            if not idle:
                data.read_first_batch()  # a data error surfaces before the run's folder or files are made
            summary = (recorded_summary(cfg, runtime, start, ckpt.tokens_before) if idle else
                       _run(cfg, runtime, model, optimizer, data, ckpt, start, device, choice, flag, faults))
        finally:
            ckpt.close()
            data.close()
            model = optimizer = None  # tensor-parallel layers and distributed optimizers hold process groups:
            if owns_runtime:          # free them before the runtime tears the groups down (pipeline.layout)
                close_runtime(runtime, failing=sys.exc_info()[1] is not None)
    if runtime.is_main and not idle:
        (out_dir / "summary.json").write_text(json.dumps(summary.as_dict(), indent=2))
    return summary


def close_runtime(runtime: TrainerRuntime, failing: bool) -> None:
    """Tear the process groups down. While an error propagates (a dead or hung peer may be why) the teardown's
    barrier gets TEARDOWN_AFTER_ERROR_S instead of the step timeout and its own failure is dropped: a rank whose
    collective timed out then exits at once, so that the launcher can end the hung rank and restart the job within
    parallel.timeout_s of the hang, and the original error is the one reported."""
    if not failing:
        runtime.close()
        return
    try:
        set_phase_timeout(runtime, TEARDOWN_AFTER_ERROR_S)
        runtime.close()
    except Exception:
        pass


def choose_precision(cfg: Config, device: torch.device) -> PrecisionChoice:
    """train.precision on this device (auto resolved), with a warning when bf16 is asked for where it is emulated."""
    def slowdown() -> float:  # both peaks are cached per machine: measured once, about 2 s each
        return cpu_peak("fp32").tflops / cpu_peak("bf16").tflops

    return resolve_precision(cfg.train.precision, device, slowdown)


def build_model_and_optimizer(cfg: Config, runtime: TrainerRuntime, device: torch.device,
                              native_bf16: bool | None = None, init: bool = True):
    """The model as the runtime runs it (split, wrapped) and its optimizer, distributed as the layout needs. The model
    is built on the meta device and each rank materialises only what it holds (its tensor-parallel pieces of its
    pipeline stage's parameters): initialised (init, split over the data-parallel ranks, see
    megaloop.train.build), or only allocated (init=False: a resumed job, whose checkpoint fills every parameter).
    native_bf16: the device computes bf16 natively (Muon's Polar Express runs in bf16 then, else in fp32); None: ask
    the device."""
    from megaloop.model.attention import set_attention_backend

    precision = cfg.train.precision
    if native_bf16 is None:
        native_bf16 = bf16_support(device).native
    model = build_model(cfg.model, device="meta").to(param_dtype(precision))
    model.set_execution(cfg.train.activation_checkpointing, cfg.train.compiles(device.type))
    set_attention_backend(model, resolve_attention_backend(cfg.model.attention, device),  # once, not per call
                          configured=cfg.model.attention != "auto")
    split = runtime.tp_size > 1 or runtime.pp_size > 1  # the runtime splits the model before it is materialised
    names = runtime.held_parameter_names(model) if split else None
    fill = (held_parameters(cfg.model, cfg.train.seed, device, names, init_split(runtime)) if init else
            empty_parameters(device, names))
    fill = with_fp8(fill, cfg.train, runtime)  # train.fp8: the split layers converted as each rank holds them
    if split:
        model = runtime.prepare_model(model, materialize=fill)
    else:
        fill(model, None)
        model = runtime.prepare_model(model)
    parts = runtime.optimizer_parts()
    optimizer = build_optimizer(model.named_parameters(), cfg.optim, cfg.train.steps, parts=parts)
    return model, runtime.prepare_optimizer(apply_optimizer_precision(optimizer, precision, native_bf16))


def init_split(runtime: TrainerRuntime) -> InitSplit | None:
    """The data-parallel group that shares this rank's init (None: a single process, or dp 1)."""
    layout = runtime.layout
    if layout is None or layout.dp == 1:
        return None
    return InitSplit(layout.dp_group, tuple(layout.dp_ranks), layout.dp_rank)


def _run(cfg, runtime: TrainerRuntime, model, optimizer, data: DataSource, ckpt, start, device,
         choice: PrecisionChoice, flag, faults: Faults) -> RunSummary:
    """Steps start .. train.steps (or until an agreed stop), the checkpoints, then the final validation."""
    out_dir = Path(cfg.train.out_dir)
    sampler = make_sampler(cfg.model.depth_sampler, cfg.model.mu_rec, cfg.model.backprop_depth, seed=cfg.train.seed)
    # counted on the meta device from the config: under tensor parallelism `model` holds only this rank's shard
    summary = RunSummary(n_params=count_parameters(build_model(cfg.model, device="meta")), is_main=runtime.is_main,
                         start_step=start, steps_done=start, resumed_from=ckpt.resumed_from,
                         tokens=ckpt.tokens_before, run=run_record(cfg))
    guard = PeakGuard(device, cfg.train.precision, runtime.world_size, _cpu_core_share(device, runtime.is_main))
    _note_peak(summary, guard)
    summary.precision, summary.precision_why = choice.precision, choice.why
    summary.attention = resolve_attention_backend(cfg.model.attention, device)  # as built (the lookups are cached)
    if runtime.is_main:
        _print_header(cfg, runtime, summary, choice)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    writer = MetricsWriter(out_dir, enabled=runtime.is_main,  # train.wandb: rank 0 mirrors the records to W&B
                           wandb=open_wandb(cfg, out_dir) if runtime.is_main else None)
    ckpt.mark(None)
    if start:
        writer.write({"kind": "resume", "step": start, "from": ckpt.resumed_from or "", **ckpt.resume_io.as_record()})
    if runtime.is_main:  # an attempt after failures: what each cost (cause, rank, node, steps and time lost)
        summary.restarts = record_restarts(out_dir, start, writer.write)
    val_depths = cfg.train.val_depths or default_val_depths(cfg.model.mu_rec, cfg.model.is_looped)
    progress = Progress(cfg.train.steps, enabled=runtime.is_main and cfg.train.progress, initial=start,
                        tokens_per_step=tokens_per_step(cfg))
    heartbeat = Heartbeat(out_dir, runtime.rank, cfg.train.heartbeat_every)
    try:
        ckpt.record = writer.write  # a failed save leaves a metrics record
        flag.begin_steps(deadline_from(cfg.train.time_limit_s))  # signals now ask for the agreed stop
        set_phase_timeout(runtime, cfg.parallel.timeout_s)  # the step timeout from here (saves: the start-up one)
        heartbeat.start(start)
        skips = _run_steps(cfg, model, optimizer, sampler, FlopModel.of(cfg.model), data, runtime, writer, progress,
                   summary, flag, val_depths, ckpt, guard, heartbeat, faults)
        heartbeat.close(summary.steps_done)
        _note_peak(summary, guard)
        if summary.steps_done > start and not summary.spike_stop:  # must land: a failure raises SaveFailed, and
            ckpt.save(summary.steps_done, model, optimizer, data, summary.tokens,  # no marker is written
                      data_step=skips.batch_of(summary.steps_done), wait=True)
        if summary.interrupted:  # before any rank can exit (a launcher may then signal the others)
            ckpt.mark("STOPPED", step=ckpt.last_saved_step or 0 if summary.spike_stop else summary.steps_done,
                      reason=summary.stop_reason, **({"requeue": False} if summary.spike_stop else {}))
        runtime.barrier()  # every rank leaves after rank 0 committed the checkpoint
        if not summary.interrupted and summary.steps_done > start:
            summary.val = validation_losses(model, data.val_batches(), final_val_depths(cfg, val_depths),
                                            cfg.train.seed, cfg.train.precision, device, runtime,
                                            data.bytes_per_token)
            for depth, v in summary.val.items():
                writer.write({"kind": "val", "step": summary.steps_done, "T": depth, **v})
        if not summary.interrupted:
            ckpt.mark("COMPLETED", step=summary.steps_done,
                      **({"reason": summary.stop_reason} if summary.stop_reason else {}))
    finally:
        ckpt.record = lambda record: None
        progress.close()
        writer.close()
    return summary


def _cpu_core_share(device, is_main: bool) -> float:
    """On CPU, the share of a one-process peak each process gets (core_share); the main rank warns once when the
    node's processes x threads exceed its available cores."""
    if device.type != "cpu":
        return 1.0
    processes, threads = local_processes(), torch.get_num_threads()
    warning = oversubscription_warning(processes, threads)
    if warning and is_main:
        print(f"megaloop: warning: {warning}", file=sys.stderr, flush=True)
    return core_share(processes, threads)


def _note_peak(summary: RunSummary, guard: PeakGuard) -> None:
    """The job's peak (every process's device) into the summary, as the guard holds it now."""
    peak, n = guard.peak, guard.world_size
    summary.peak_tflops = guard.job_tflops
    share = "" if guard.share == 1 else f" x {guard.share:.3g} (processes share the cores)"
    summary.peak_source = peak.source if n == 1 and not share else f"{n} x {peak.tflops:.4f}{share}, {peak.source}"
    summary.peak_unreliable_steps = guard.unreliable_steps


def _print_header(cfg: Config, runtime: TrainerRuntime, summary: RunSummary, choice: PrecisionChoice) -> None:
    """One line before the first step: what runs where, in which precision and why, against which peak, for how
    many steps and tokens."""
    layout = runtime.describe_layout()
    print(f"megaloop: train {cfg.train.out_dir}: {summary.n_params / 1e6:.2f}M params, tp={layout['tp']} "
          f"pp={layout.get('pp', 1)} dp={layout['dp']}, {choice.header()}; attention {summary.attention}; peak "
          f"{summary.peak_tflops:.4f} TFLOP/s ({summary.peak_source}); run {budget_line(cfg)}", file=sys.stderr,
          flush=True)
    groups = layout.get("process_groups")
    if groups and groups["groups"]:
        from pipeline.groups import describe_groups

        print(f"megaloop: process groups: {describe_groups(groups)}", file=sys.stderr, flush=True)
    if choice.warning:
        print(f"megaloop: warning: {choice.warning}", file=sys.stderr, flush=True)


def _note_attention(summary, main: bool) -> None:
    """The attention kernels that ran in this job's first step (eager calls), into the summary and one line."""
    summary.attention_calls, summary.attention_fallbacks = kernel_calls()
    if main:
        ran = ", ".join(f"{k} {n} calls" for k, n in sorted(summary.attention_calls.items())) or \
            "not counted (compiled graphs)"
        fell = f"; fell back to sdpa {sum(summary.attention_fallbacks.values())} times" \
            if summary.attention_fallbacks else ""
        print(f"megaloop: attention that ran in step {summary.start_step}: {ran}{fell}", flush=True)


def _run_steps(cfg, model, optimizer, sampler, flop_model, data: DataSource, runtime: TrainerRuntime, writer,
               progress, summary, flag, val_depths, ckpt, guard, heartbeat: Heartbeat, faults: Faults) -> SkipWindows:
    model.train()
    feed = BatchFeed(data, cfg, runtime.is_main)
    ckpt.track("skip_windows", feed.skips)  # the batches rollbacks skip, and the loader's offset from the step
    consecutive_skips = 0
    spikes = SpikeMonitor(cfg.train, runtime)
    ckpt.track("spike_detector", spikes)  # its window is saved, and restored from the resumed checkpoint
    cadence = Cadence(cfg.checkpoint.every_minutes)
    timer = StepTimer(runtime.device)  # one over the steps: on a GPU each step's times are read at the next
    reset_kernel_calls()
    step = summary.start_step
    while step < cfg.train.steps:
        t0 = time.perf_counter()
        batch = feed.next(step)
        if batch is None:  # data.max_epochs: the run is complete
            summary.stop_reason = f"data.max_epochs={cfg.data.max_epochs} reached"
            break
        t_data = time.perf_counter() - t0
        if faults:
            batch = faults.corrupt(step, batch, cfg.model.vocab_size)
            faults.in_step()
        depth_sample = sampler.sample(step, batch["sample_index"])
        due = functools.partial(cadence.due, ckpt.slowest_stall_s, ckpt.slowest_write_s)
        stats = train_step(model, optimizer, batch, depth_sample, step, cfg.train.seed, cfg, runtime, flop_model,
                           timer=timer, stop_code=functools.partial(_stop_code, flag, ckpt, t0, heartbeat, due),
                           veto=spikes.veto)
        flag.note_step(time.perf_counter() - t0)
        figures = reduce_step(stats, runtime)  # the step's one reduction (launched inside the step), read here
        dt = time.perf_counter() - t0
        record = _train_record(step, stats, figures, t_data, dt, summary, optimizer, guard)
        record["epoch"] = summary.epoch = feed.epoch
        _note_data(record, summary, data, t_data)
        _note_gpu_memory(record, summary, runtime.device)
        summary.steps_done = step + 1
        heartbeat.beat(step + 1, dt, last=step + 1 == cfg.train.steps)
        if faults:
            faults.after_step(step)
        summary.losses.append(record["loss"])
        if step % cfg.train.log_every == 0 or step == cfg.train.steps - 1:
            writer.write(record)
        progress.update(record)
        spike = spikes.after_step(step, record["loss"])
        if spike is not None:
            writer.write(spike.record(figures.telemetry, cfg.train.on_spike))
        if step == summary.start_step:
            ckpt.prepare(model, optimizer)  # the optimizer state exists now: host buffers for the saves
            _note_attention(summary, runtime.is_main)
        consecutive_skips = consecutive_skips + 1 if record["skipped"] else 0
        if consecutive_skips >= cfg.train.max_consecutive_skips:
            raise TrainingDiverged(_diverged_message(cfg, step, consecutive_skips))
        done = step + 1
        if spike is not None and spikes.action == "rollback":
            restored = _roll_back(cfg, spike, int(batch["step"]), model, optimizer, data, ckpt, spikes, feed, summary,
                                  writer, runtime.is_main)
            if restored is not None:
                cadence.saved()  # the restored state is as old as its checkpoint: the interval starts again
                step = restored
                continue
        if spike is not None and spikes.action in ("stop", "rollback"):
            _stop_for_spike(cfg, spike, ckpt, summary, runtime.is_main)
            break
        if flag.decide(figures.stop_code):  # every rank saw the same code: all stop after this step
            summary.interrupted, summary.stop_reason = True, flag.reason
            break
        if cfg.train.stop_at_step is not None and done >= cfg.train.stop_at_step and done < cfg.train.steps:
            summary.interrupted, summary.stop_reason = True, f"train.stop_at_step={cfg.train.stop_at_step}"
            break
        by_steps = cfg.checkpoint.every and done % cfg.checkpoint.every == 0
        if (by_steps or figures.stop_code == SAVE_DUE_CODE) and done < cfg.train.steps:
            cadence.saved()  # the interval runs from save to save (a slow save does not stretch it)
            ckpt.save(done, model, optimizer, data, summary.tokens, data_step=feed.skips.batch_of(done))
        if done % cfg.train.val_every == 0 and done < cfg.train.steps:
            val = validation_losses(model, data.val_batches(), val_depths, cfg.train.seed, cfg.train.precision,
                                    runtime.device, runtime, data.bytes_per_token)
            for depth, v in val.items():
                writer.write({"kind": "val", "step": done, "T": depth, **v})
            progress.note(" ".join(f"T{t}:{v['val_loss']:.3f}" for t, v in val.items()))
        step = done
    return feed.skips


def _diverged_message(cfg, step: int, skips: int) -> str:
    reduced = cfg.train.precision not in ("fp32", "fp64")  # fp32 is advice only where it is more precise
    return (f"stopped at step {step}: the last {skips} steps were all skipped because the gradient "
            "norm was not finite (likely causes: a learning rate too high for this model, "
            f"{'overflow in reduced precision, ' if reduced else ''}or corrupt data); lower optim.matrix_lr / "
            f"optim.adam_lr, {'try train.precision=fp32, ' if reduced else ''}or raise "
            "train.max_consecutive_skips")


def _roll_back(cfg, spike, spike_batch: int, model, optimizer, data: DataSource, ckpt, spikes, feed, summary,
               writer, is_main: bool) -> int | None:
    """train.on_spike=rollback: restore the newest checkpoint from before the spike's step, skip the global batches
    of a window ending at the spike's (train.rollback_skip of them, none before the checkpoint's position), record
    it; the step to continue from, or None when there is nothing to roll back to or the rollbacks are used up (the
    run then stops as under train.on_spike=stop)."""
    skips = feed.skips
    if skips.rollbacks >= cfg.train.max_rollbacks:
        summary.stop_reason = f"train.max_rollbacks={cfg.train.max_rollbacks} used up"
        return None
    restored = ckpt.roll_back(model, optimizer, data, before_step=spike.step, keep=("skip_windows",))
    if restored is None:
        summary.stop_reason = "no checkpoint from before the spike to roll back to"
        return None
    position = data.state_dict()["step"]  # the restored checkpoint's global batch
    first = max(position, spike_batch - cfg.train.rollback_skip + 1)
    skips.rolled_back(offset=position - restored, first=first, last=spike_batch)
    feed.restart()
    G = cfg.data.global_batch_size
    record = {"kind": "rollback", "step": spike.step, "restored_step": restored,
              "skipped_batches": list(range(first, spike_batch + 1)),
              "skipped_samples": [[first * G, (spike_batch + 1) * G]], "rollbacks": skips.rollbacks}
    writer.write(record)
    summary.rollbacks.append(record)
    if is_main:
        print(f"megaloop: loss spike at step {spike.step} (loss {spike.loss:.4g} > threshold "
              f"{spike.threshold:.4g}): rolled back to the checkpoint of step {restored} and skipping global batches "
              f"{first}..{spike_batch} (samples {first * G}..{(spike_batch + 1) * G - 1}); rollback "
              f"{skips.rollbacks} of at most {cfg.train.max_rollbacks}", file=sys.stderr, flush=True)
    del summary.losses[max(restored - summary.start_step, 0):]
    summary.start_step = min(summary.start_step, restored)
    summary.steps_done, summary.tokens = restored, ckpt.tokens_before
    return restored


def _stop_for_spike(cfg, spike, ckpt, summary, is_main: bool) -> None:
    """train.on_spike=stop (or a rollback that could not be made): stop without saving the state the spike's step
    left, and set aside any checkpoint of the spike's step or later, so that the newest checkpoint is one from
    before it; the STOPPED marker then says not to requeue (the run needs a person: a lower learning rate, other
    data)."""
    why = summary.stop_reason
    ckpt.set_aside_from(spike.step, suffix="after-spike")
    summary.interrupted, summary.spike_stop = True, True
    summary.stop_reason = f"loss spike at step {spike.step} (train.on_spike={cfg.train.on_spike}" + \
        (f": {why})" if why else ")")
    if is_main:
        print(stop_message(spike, cfg.train.out_dir, why), file=sys.stderr, flush=True)


class BatchFeed:
    """The training batches in step order: global batch step + offset, jumping over the windows that rollbacks skip
    (spikes.SkipWindows), stopping at data.max_epochs, and saying once when the corpus wraps."""

    def __init__(self, data: DataSource, cfg, is_main: bool):
        self.data, self.cfg, self.is_main = data, cfg, is_main
        self.skips = SkipWindows()
        self.batches = None
        self.next_batch: int | None = None  # the loader's position, once known
        self.epoch = 0
        self._warned = False

    def restart(self) -> None:
        """The loader was repositioned (a rollback loaded a checkpoint): read from its new position."""
        self.batches, self.next_batch = None, None

    def next(self, step: int) -> dict | None:
        """The batch of `step` (None: data.max_epochs is reached before it)."""
        want = self.skips.advance(step)
        epoch = self.data.epoch_of(want)
        if self.cfg.data.max_epochs is not None and epoch >= self.cfg.data.max_epochs:
            return None
        if self.batches is None or want != self.next_batch:
            self.data.seek(want)  # nothing to do when the loader is there already
            self.batches = self.data.train_batches()
        batch = next(self.batches)
        got = int(batch["step"])
        if got != want:
            raise RuntimeError(f"the data loader gave global batch {got} for step {step}, not {want}")
        self.next_batch = want + 1
        if epoch > self.epoch and not self._warned and self.is_main:
            print(f"megaloop: warning: the corpus wrapped: step {step} reads epoch {epoch} (the training data is "
                  f"seen again; data.max_epochs ends a run after a number of passes)", file=sys.stderr, flush=True)
            self._warned = True
        self.epoch = epoch
        return batch


def _note_data(record: dict, summary: RunSummary, data: DataSource, t_data: float) -> None:
    """The loader's figures into the step's record and the summary: its wait, bytes downloaded, cache hit ratio."""
    io = data.stream_stats()
    summary.data_wait_s += t_data
    summary.data_bytes_downloaded, summary.data_cache_hit_ratio = io["bytes_downloaded"], io["hit_ratio"]
    summary.data_shards_skipped = io["shards_skipped"]
    record["data_bytes_downloaded"], record["data_cache_hit_ratio"] = io["bytes_downloaded"], io["hit_ratio"]


def _stop_code(flag, ckpt, t0: float, heartbeat: Heartbeat, save_due) -> int:
    """This rank's stop code, taken inside the step when its statistics are packed (after the micro-batches): the
    step so far counts towards the slowest step (the time budget's margin), as does the slowest save. The step so
    far is also this rank's own time in the step (its data, forward and backward, before it waits for the other
    ranks at the step's reduction): the heartbeat's busy time, which shows a straggler where wall times do not."""
    heartbeat.ready(time.perf_counter() - t0)
    flag.note_step(time.perf_counter() - t0)
    flag.note_save(ckpt.slowest_save_s)
    return flag.local_code() or (SAVE_DUE_CODE if save_due() else 0)


def _note_gpu_memory(record: dict, summary, device: torch.device) -> None:
    """This rank's CUDA allocator peaks so far (bytes; NaN off a GPU) into the record and the summary: what its
    tensors held at most, and what the allocator reserved from the device for them (the gap is fragmentation and
    cached blocks). Reading them does not synchronise the device."""
    if device.type != "cuda":
        record["gpu_max_allocated"] = record["gpu_max_reserved"] = float("nan")
        return
    record["gpu_max_allocated"] = torch.cuda.max_memory_allocated(device)
    record["gpu_max_reserved"] = torch.cuda.max_memory_reserved(device)
    summary.gpu_max_allocated = max(summary.gpu_max_allocated, record["gpu_max_allocated"])
    summary.gpu_max_reserved = max(summary.gpu_max_reserved, record["gpu_max_reserved"])


def _train_record(step, stats, figures, t_data, dt, summary, optimizer, guard: PeakGuard) -> dict:
    """The step's metrics record from its job-wide figures (no further communication)."""
    rec, tokens = stats.record, figures.tokens
    useful, executed = figures.useful_flops, figures.executed_flops
    summary.tokens += tokens
    summary.job_tokens += tokens
    summary.train_time_s += dt
    summary.useful_flops += useful
    summary.executed_flops += executed
    summary.skipped = optimizer.num_skipped
    mfu, hfu = guard.utilisation(useful / dt, executed / dt)  # NaN, never above 100%, when the peak is too low
    tel = figures.telemetry
    return {
        "kind": "train", "step": step, "loss": figures.loss, "lr": rec.matrix_lr, "grad_norm": float(rec.grad_norm),
        "skipped": bool(rec.skipped), "skipped_total": optimizer.num_skipped, "tokens": tokens,
        "tokens_per_s": tokens / dt, "rho_A": tel["rho_A"], "state_norm": tel["state_norm"],
        "recurrent_residual": tel["recurrent_residual"], "mean_depth": figures.mean_depth,
        "executed_depth": figures.executed_depth, "idle_fraction": figures.idle_fraction,
        "idle_fraction_loop": figures.idle_fraction_loop, "useful_flops": useful, "executed_flops": executed,
        "mfu": mfu, "hfu": hfu,
        "time_data": t_data, "time_forward": stats.times["forward"], "time_backward": stats.times["backward"],
        "time_optimizer": stats.times["optimizer"], "time_communication": stats.times["communication"],
        "time_pipeline_idle": stats.times["pipeline_idle"], "time_phases_step": stats.times_step, "time_step": dt,
    }
