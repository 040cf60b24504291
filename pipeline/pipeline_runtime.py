"""The ring pipeline in the trainer: the runtime of a job with pp > 1 (composed with tensor and data parallelism).

    runtime = PipelineRuntime(layout, tp_plan, muon_functions, stage_functions, zero_stage=1)
    names = runtime.held_parameter_names(meta_model)       # what this rank's stage holds (build only those)
    model = runtime.prepare_model(meta_model, materialize)  # a PipelineStage: this rank's parameters only
    runtime.run_micro_batches(model, micro_batches, scales, autocast)   # one step's ring schedule
    runtime.reduce_gradients(model)    # tied embedding summed between first and last stage, then dp (and tp partials)
    runtime.forward_losses(model, micro_batches, autocast)              # validation: losses on every rank

Each pp rank holds one stage of the model (megaloop decides which parameters: `StageFunctions.parameter_names`) and
computes it through a stage program (`StageFunctions.program`, megaloop.model.stages.LoopedStageProgram) that the
ring executor (pipeline/ring/execute.py) drives along this rank's action list from the ring schedule
(pipeline/ring/generate.py). All ranks of a pp group see the same micro-batches and depths (the data and depths are
functions of the dp rank, the step and the sample index), so they compute the same schedule without talking.

Gradients: the parameters shared by the first and the last stage (the tied embedding) get their two partial
gradients summed over the layout's embed group before the data-parallel reduction; every other parameter lives on
one stage. The global gradient norm sums over the pp group (pipeline/grad_norm.py) with the shared parameters
counted on the first stage only. The data-parallel reduction runs after the ring, not overlapped with it.
"""
from __future__ import annotations

import collections
import contextlib
import threading
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from pipeline.grad_buffer import flat_all_reduce_
from pipeline.micro_batches import MicroBatchResult, NoTimer
from pipeline.model_view import ModelView
from pipeline.parallel_lm import ParallelLM
from pipeline.ring import MicroBatch, chain, rank_of, ring_schedule, with_p2p
from pipeline.ring.actions import Backward, Embed, EmbedBackward, Forward, Loss, LossBackward
from pipeline.groups import GroupStats
from pipeline.layout import group_ranks
from pipeline.ring.channels import ring_channels
from pipeline.ring.execute import RingExecutor
from pipeline.runtime import ParallelRuntime
from pipeline.tensor_parallel import TensorParallelInfo
from pipeline.vocab_parallel import vocab_parallel_cross_entropy

BACKWARD_ACTIONS = (Backward, LossBackward, EmbedBackward)


@dataclass(frozen=True)
class StageFunctions:
    """What the runtime needs from the model's package (pipeline never imports megaloop):

    parameter_names(model, stage, pp) -> the names of the parameters stage `stage` holds;
    program(model, stage, pp, micro_batches, scales, loss_fn, autocast) -> a stage program (pipeline.ring.program
    StageProgram) that also has specs() (one dict of pipeline.ring.MicroBatch fields per micro-batch),
    message_dtype(), losses (mb -> unscaled loss, last stage) and telemetry(mb)."""

    parameter_names: Callable
    program: Callable


class PipelineStage(ModelView):
    """This rank's stage of a model split over the pipeline: the parameters, modes and state the trainer reads
    (only what the stage holds); it is not called: the runtime runs micro-batches through the stage program with
    `model` (split in place under tp)."""

    def __init__(self, model: torch.nn.Module, held: list[str]):
        self.model = model
        self.held = set(held)

    def holds(self, name: str) -> bool:
        return name in self.held

    def __call__(self, *args, **kwargs):
        raise TypeError("a pipeline stage holds part of the model and is not called: hand micro-batches to "
                        "runtime.run_micro_batches (training) or runtime.forward_losses (evaluation)")


def forward_orders(specs, pp: int) -> list[list]:
    """Per-rank compute orders that run the micro-batches `specs` forward only (Embed, every lap's Forward, Loss;
    no backward): every rank takes its actions in one global order, lap by lap and within a lap micro-batch by
    micro-batch (Embed before lap 0, Loss after the micro-batch's last lap). Every action's input comes from an
    action earlier in that order, so with asynchronous sends no rank waits on one that waits for it, and with pp
    micro-batches every rank has work while the others run theirs."""
    key = {Embed: lambda a: (-1, a.mb, 0), Forward: lambda a: (a.lap, a.mb, a.stage),
           Loss: lambda a: (specs[a.mb].laps - 1, a.mb, pp)}
    actions = [a for mb, spec in enumerate(specs) for a in chain(mb, spec, pp) if type(a) in key]
    actions.sort(key=lambda a: key[type(a)](a))
    return [[a for a in actions if rank_of(a, pp) == rank] for rank in range(pp)]


SCHEDULES_KEPT = 16  # ring schedules kept by their micro-batch specs (the loader prefetches a few steps ahead)


def autocast_cache_region(device: torch.device):
    """A region around a ring run that keeps autocast's weight casts, not one that autocasts: autocast is OFF in
    it (the executor's backward calls run as they would outside autocast). The stage program enters autocast for
    each of its actions; nested in this region, leaving one does not end the region, and autocast keeps the
    low-precision copy of each weight it casts until the outermost region ends: a weight is cast once per run
    instead of once per lap and micro-batch."""
    return torch.autocast(torch.device(device).type, enabled=False)


class PipelineRuntime(ParallelRuntime):
    """Ring pipeline x tensor x data parallelism for the trainer; see the module docstring. At most `in_flight` x pp
    micro-batches hold lap activations at once on any rank (the ring schedule's memory bound; 2 x that many are
    between their embedding and its backward);
    `check_messages`: every message checked against what its Recv expects (pipeline.ring.execute; for debugging).
    `p2p_semantics`: auto (the backend's own) | rendezvous (NCCL's, emulated on gloo: a send completes only when its
    receive does, one group's batches run in order; pipeline.ring.rendezvous); `timeout_s` bounds each wait of a
    message. Creating the runtime is collective:
    it makes every pipeline's channel groups (pipeline.ring.channels)."""

    runs_pipeline = True
    plans_ahead = True  # the trainer calls plan_ahead from the loader's prefetch thread

    def __init__(self, layout, tp_plan, muon_functions, stage_functions: StageFunctions, zero_stage: int = 1,
                 grad_reduce_dtype: str = "fp32", in_flight: int = 3, check_messages: bool = False,
                 p2p_semantics: str = "auto", timeout_s: float = 600.0, bucket_elements: int | None = None,
                 overlap_param_gather: bool = True, grad_buckets: str = "backward"):
        super().__init__(layout, tp_plan, muon_functions, zero_stage=zero_stage, bucket_elements=bucket_elements,
                         grad_reduce_dtype=grad_reduce_dtype, overlap_param_gather=overlap_param_gather,
                         grad_buckets=grad_buckets)
        self.stage_functions = stage_functions
        self.in_flight = in_flight
        self.check_messages = check_messages
        self.stage, self.pp = layout.pp_rank, layout.pp
        self.channels = ring_channels(group_ranks(layout.tp, layout.dp, layout.pp)["pp"], layout.rank, p2p_semantics,
                                      timeout_s=timeout_s)
        self.shared: set[str] = set()
        self._schedules: collections.OrderedDict = collections.OrderedDict()  # specs' key -> this rank's actions
        self._schedules_lock = threading.Lock()
        self.schedules_made_in_step = 0  # schedules generated inside run_micro_batches (not ahead of the step)

    pp_size = property(lambda self: self.layout.pp)

    # ---- model ---------------------------------------------------------------------------------------------
    def held_parameter_names(self, model) -> list[str]:
        """The parameters this rank's stage holds (model: the whole model, e.g. built on the meta device)."""
        return list(self.stage_functions.parameter_names(model, self.stage, self.pp))

    def prepare_model(self, model: torch.nn.Module, materialize=None) -> PipelineStage:
        """Split the model over tp (tp > 1), materialise what this stage holds (materialize(model, tp_info), see
        ParallelRuntime.prepare_model; the trainer passes one that fills only `held_parameter_names`) and put the
        stage's gradients in the buffer; returns the PipelineStage."""
        held = self.held_parameter_names(model)
        first = set(self.stage_functions.parameter_names(model, 0, self.pp))
        self.shared = first & set(self.stage_functions.parameter_names(model, self.pp - 1, self.pp))
        self.model = model
        if self.layout.tp > 1:  # splits the model in place (and sets its sequence shard)
            self.tp_info = ParallelLM(model, self.layout, self.tp_plan).tp_info
        else:
            self.tp_info = TensorParallelInfo(replicated=[n for n, _ in model.named_parameters()])
        if materialize is not None:
            materialize(model, self.tp_info)
        stage = PipelineStage(model, held)
        missing = [n for n, p in stage.named_parameters() if p.is_meta]
        if missing:
            raise RuntimeError(f"stage {self.stage} holds parameters still on the meta device: {missing[:3]}; "
                               "materialise them (megaloop.train.build.held_parameters with the held names)")
        self.defer_buffer(stage.named_parameters())  # laid out when needed (ParallelRuntime.defer_buffer)
        return stage

    def uncounted_names(self) -> set[str]:
        """Parameters whose gradient this rank leaves out of the global norm: the shared ones on the last stage
        (the first stage counts them)."""
        return self.shared if self.stage == self.pp - 1 else set()

    # ---- one step ------------------------------------------------------------------------------------------
    def run_micro_batches(self, model: PipelineStage, micro_batches, scales, autocast=contextlib.nullcontext,
                          timer=None) -> list:
        """The step's micro-batches through the ring schedule (forward and backward interleaved: the timer's
        "forward" span is the whole run). Results: each micro-batch's unscaled loss (zero on all but the last
        stage) and telemetry (each value from the stage that computes it, zero elsewhere). The overlapped parameter
        all-gather is finished first: a stage program reads weights outside their modules' calls (the tied head)."""
        self.finish_param_gather()
        timer = timer or NoTimer()
        t0 = timer.mark()
        program = self._program(model, micro_batches, scales, autocast)
        specs = [MicroBatch(**spec) for spec in program.specs()]
        actions = self._schedule(specs, ahead=False)
        with autocast_cache_region(self.device):
            ran = self._executor(program).run(actions, specs)
        t1 = timer.mark()
        if getattr(timer, "cuda", True) or ran is None:  # device work is asynchronous: the run as a whole
            timer.add("forward", t0, t1)
        else:  # host wall times: each compute action, and each wait for a neighbour's messages
            for action, start, end in ran.timings:
                timer.add("backward" if isinstance(action, BACKWARD_ACTIONS) else "forward", start, end)
            for _, posted, done in ran.posts:
                timer.add("pipeline_idle", posted, done)
        return [self._result(program, mb) for mb in range(len(specs))]

    def plan_ahead(self, model: PipelineStage, micro_batches) -> None:
        """Generate and keep the ring schedule of a coming step's micro-batches (host tensors are enough: only
        their shapes and depths count), so that run_micro_batches finds it made. Thread-safe: the trainer calls it
        from the data loader's prefetch thread while the device runs the current step."""
        program = self._program(model, micro_batches, [1.0] * len(micro_batches), contextlib.nullcontext)
        self._schedule([MicroBatch(**spec) for spec in program.specs()], ahead=True)

    def _schedule(self, specs, ahead: bool) -> list:
        """This rank's actions for `specs`: the kept schedule of the same specs, else generated now (and kept; the
        last SCHEDULES_KEPT are)."""
        key = tuple((s.laps, s.grad_laps, s.active) for s in specs)
        with self._schedules_lock:
            actions = self._schedules.get(key)
        if actions is None:
            actions = ring_schedule(specs, self.pp, max_in_flight=self.in_flight * self.pp)[self.stage]
            self.schedules_made_in_step += not ahead
        with self._schedules_lock:
            self._schedules[key] = actions
            self._schedules.move_to_end(key)
            while len(self._schedules) > SCHEDULES_KEPT:
                self._schedules.popitem(last=False)
        return actions

    def overlap_next_backward(self) -> None:
        """Nothing: under the ring the data-parallel reduction runs after the step's last backward."""

    def reduce_gradients(self, model=None) -> None:
        """The shared parameters' gradients summed between the first and last stage, then as ParallelRuntime."""
        if self.shared:
            grads = [p.grad for n, p in model.named_parameters() if n in self.shared and p.grad is not None]
            flat_all_reduce_(grads, self.layout.embed_group)
        super().reduce_gradients(model)

    @torch.no_grad()
    def forward_losses(self, model: PipelineStage, micro_batches, autocast=contextlib.nullcontext) -> list[float]:
        """Each micro-batch's mean token loss (no backward), on every rank: pp micro-batches at a time around the
        ring (forward_orders), the last stage's losses broadcast over the pp group."""
        self.finish_param_gather()
        losses = torch.zeros(len(micro_batches), dtype=torch.float64)
        for lo in range(0, len(micro_batches), self.pp):
            group = list(micro_batches[lo:lo + self.pp])
            program = self._program(model, group, [1.0] * len(group), autocast)
            specs = [MicroBatch(**spec | {"grad_laps": 1}) for spec in program.specs()]
            with autocast_cache_region(self.device):
                self._executor(program).run(with_p2p(forward_orders(specs, self.pp), specs)[self.stage], specs)
            if self.stage == self.pp - 1:
                losses[lo:lo + len(group)] = torch.stack([program.losses[mb] for mb in range(len(group))]).cpu()
        losses = losses.to(self._comm_device())
        dist.broadcast(losses, self.layout.pp_ranks[-1], group=self.layout.pp_group)
        return losses.cpu().tolist()

    def _program(self, model: PipelineStage, micro_batches, scales, autocast):
        loss_fn = self._vocab_parallel_loss if self.layout.tp > 1 else None
        return self.stage_functions.program(model.model, self.stage, self.pp, micro_batches, scales, loss_fn,
                                            autocast)

    def _vocab_parallel_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean token loss of this rank's vocabulary slice of the logits (the full cross-entropy)."""
        return vocab_parallel_cross_entropy(logits, labels, self.layout, vocab_start=self.tp_info.vocab_range[0])

    def _executor(self, program) -> RingExecutor:
        return RingExecutor(program, dtype=program.message_dtype(), device=self.device,
                            check_messages=self.check_messages, channels=self.channels)

    def close(self) -> None:
        """Ends the channels (and their rendezvous emulation's threads), then as ParallelRuntime."""
        if self.channels is not None:
            self.channels.close()
            self.channels = None
        super().close()

    def _result(self, program, mb: int) -> MicroBatchResult:
        loss = program.losses.get(mb)
        if loss is None:
            loss = torch.zeros((), dtype=torch.float64)
        return MicroBatchResult(loss, program.telemetry(mb))

    def describe_layout(self) -> dict:
        return super().describe_layout() | {"pp_in_flight": self.in_flight}

    def group_stats(self):
        """The layout's groups and every pipeline's ring channels (pipeline.groups)."""
        stats = GroupStats()
        stats.add(self.layout.group_stats)
        if self.channels is not None:
            stats.add(self.channels.stats)
        return stats
