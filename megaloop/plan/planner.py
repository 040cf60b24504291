"""The memory plan of a job: per-rank terms for a micro-batch size and checkpointing setting, and the largest
micro-batch that fits a GPU.

peak = parameters + gradients + optimizer state + max(activations of one micro-batch at their peak, the optimizer
step's working memory + the last micro-batch's logits): the step runs after the last backward, when only the
logits the trainer still holds are left of the activations.

Under the ring pipeline (pp > 1) `Plan.pipeline` holds each stage's parameters, gradients, optimizer state and the
stored activations of one simulated optimizer step (megaloop/plan/pipeline.py); the terms above describe the whole
model on one rank and are not reported then. Throughput (step time from the FLOP model and the interconnect) is a
later step: `Plan.timing` is None.
"""
from __future__ import annotations

from dataclasses import dataclass

from megaloop.config import Config
from megaloop.model import build_model, count_parameters
from megaloop.plan.activations import CHECKPOINTING, ActivationTerms, activation_terms
from megaloop.plan.gpus import Gpu
from megaloop.plan.layout import Layout, LocalParam, local_params, resolve_layout
from megaloop.plan.pipeline import IN_FLIGHT_PER_STAGE, PipelinePlan, pipeline_plan
from megaloop.plan.static import StaticTerms, static_terms

MAX_MICRO_BATCH = 1 << 20


@dataclass(frozen=True)
class MemoryTerm:
    """One line of the breakdown: bytes on the most loaded rank and what they are."""

    name: str
    bytes: int
    note: str = ""


@dataclass(frozen=True)
class MicroBatchPlan:
    """Per-rank memory at one micro-batch size under one checkpointing setting."""

    micro_batch: int
    checkpointing: str
    static: StaticTerms
    activations: ActivationTerms

    @property
    def step_phase(self) -> int:
        """Beyond the persistent state during the optimizer step: its working memory, while the trainer still
        holds the last micro-batch's logits."""
        return self.static.step_working + self.activations.output_logits

    @property
    def peak(self) -> int:
        return self.static.persistent + max(self.activations.peak + self.static.dp_in_flight, self.step_phase)

    def terms(self) -> list[MemoryTerm]:
        s, a = self.static, self.activations
        rows = [
            MemoryTerm("parameters", s.params), MemoryTerm("gradients", s.grads),
            MemoryTerm("optimizer: Muon state", s.muon), MemoryTerm("optimizer: AdamW state", s.adamw),
            MemoryTerm("activations: prelude + coda blocks", a.prelude_coda),
            MemoryTerm("activations: kept laps", a.laps, f"{a.kept_laps} laps"),
            MemoryTerm("activations: once per micro-batch", a.once, "ids, value embeddings, norms, term of e, "
                       "head input"),
            MemoryTerm("activations: logits + softmax", a.logits, "fp32 [b, s, V/tp] and the saved softmax"),
            MemoryTerm("activations: bf16 weight copies", a.weight_copies),
            MemoryTerm("activations: largest transient", a.transient, _transient_note(a)),
            MemoryTerm("data-parallel buckets in flight", s.dp_in_flight, "reducer copies in the last backward, "
                       "parameter all-gather in the next forward"),
            MemoryTerm("optimizer step working memory", self.step_phase, "after backward, with the last "
                       "logits; counted when larger than the activations"),
        ]
        return rows


def _transient_note(a: ActivationTerms) -> str:
    options = {"end of forward: previous logits + loss copy": a.held_logits + a.loss_forward,
               "start of backward: cross-entropy gradients": a.loss_backward,
               "recomputation + a block's gradients": a.recompute + a.working}
    return max(options, key=options.get)


@dataclass(frozen=True)
class Plan:
    """Everything the planner knows about one job on one GPU type."""

    cfg: Config
    layout: Layout
    gpu: Gpu
    n_params: int
    params: tuple[LocalParam, ...]
    pipeline: PipelinePlan | None = None  # the ring pipeline's stages and schedule (pp > 1)
    timing: None = None  # throughput prediction: a later step

    def at(self, micro_batch: int, checkpointing: str | None = None) -> MicroBatchPlan:
        ck = checkpointing or self.cfg.train.activation_checkpointing
        static = static_terms(list(self.params), self.layout, self.cfg.train.precision,
                              self.cfg.parallel.zero_offload, self.cfg.parallel.grad_bucket_elements,
                              self.cfg.parallel.grad_buckets)
        rows = self.cfg.data.global_batch_size // self.layout.dp  # this rank's sequences per step
        acts = activation_terms(self.cfg, micro_batch, self.layout.tp, self.layout.sp, ck, self.params,
                                micro_batches=-(-rows // micro_batch))
        return MicroBatchPlan(micro_batch, ck, static, acts)

    def fits(self, micro_batch: int, checkpointing: str | None = None) -> bool:
        return self.at(micro_batch, checkpointing).peak <= self.gpu.usable_bytes

    def largest_micro_batch(self, checkpointing: str | None = None) -> int:
        """The largest b whose peak fits the GPU's usable memory (0: not even one sequence)."""
        if not self.fits(1, checkpointing):
            return 0
        low, high = 1, 2
        while high <= MAX_MICRO_BATCH and self.fits(high, checkpointing):
            low, high = high, high * 2
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if self.fits(mid, checkpointing) else (low, mid)
        return low

    def settings(self) -> tuple[str, ...]:
        return CHECKPOINTING


def make_plan(cfg: Config, gpu: Gpu, world: int, in_flight: int = IN_FLIGHT_PER_STAGE) -> Plan:
    """The plan of `cfg` on `world` GPUs of type `gpu` (raises ConfigError for a layout that cannot run); under
    pp > 1 the ring schedule keeps at most `in_flight` x pp micro-batches in flight. train.precision=auto is planned
    as bf16: every GPU the planner knows computes bf16 natively."""
    if cfg.train.precision == "auto":
        cfg = cfg.with_precision("bf16")
    layout = resolve_layout(cfg, world)
    n_params = count_parameters(build_model(cfg.model, device="meta"))
    params = local_params(cfg, layout.tp)
    pipeline = pipeline_plan(cfg, layout, params, in_flight) if layout.pp > 1 else None
    return Plan(cfg, layout, gpu, n_params, tuple(params), pipeline)
