"""What the training loop needs from the parallel layout, and its single-process form.

The trainer talks to one object with the members of megaloop.train.protocols.TrainerRuntime; pipeline/ provides the
multi-process ones (tensor, data and pipeline groups), so the loop itself has no parallel code.
"""
from __future__ import annotations

import contextlib
import functools

import torch

from megaloop.train.protocols import TrainerRuntime
from pipeline.micro_batches import plain_forward_losses, run_micro_batches


class SingleProcessRuntime:
    """World of one: every reduction is the identity."""

    rank = 0
    world_size = 1
    dp_rank = 0
    dp_size = 1
    is_main = True
    layout = None  # no process groups (a parallel runtime's pipeline.layout.ParallelLayout)
    plans_ahead = False  # plan_ahead does nothing
    device: torch.device

    def __init__(self, device: torch.device):
        self.device = device

    def held_parameter_names(self, model: torch.nn.Module) -> list[str]:
        """Every parameter: one process holds the whole model."""
        return [name for name, _ in model.named_parameters()]

    def prepare_model(self, model: torch.nn.Module, materialize=None) -> torch.nn.Module:
        """The model as it is; materialize(model, None), when given, fills it (nothing is split)."""
        if materialize is not None:
            materialize(model, None)
        return model

    def optimizer_parts(self) -> None:
        """None: the optimizer's own (undistributed) inner optimizers."""
        return None

    def prepare_optimizer(self, optimizer):
        return optimizer

    def plan_ahead(self, model, micro_batches) -> None:
        """Nothing: the micro-batches run as a plain loop, with no schedule to make ahead."""
        return None

    def run_micro_batches(self, model, micro_batches, scales, autocast=contextlib.nullcontext, timer=None) -> list:
        """Forward and backward of each of a step's micro-batches in order, loss times its scale; the per-micro-batch
        results (pipeline.micro_batches.run_micro_batches)."""
        return run_micro_batches(self, model, micro_batches, scales, autocast, timer)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def overlap_next_backward(self) -> None:
        """Called before the step's last backward (a parallel runtime reduces gradients during it)."""
        return None

    def sum_over_dp(self, value: float) -> float:
        return value

    def finish_param_gather(self) -> None:
        """Wait for a parameter all-gather still in flight after the optimizer step (a parallel runtime's)."""
        return None

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        return None

    tp_size = 1
    pp_size = 1

    def forward_losses(self, model, micro_batches, autocast=contextlib.nullcontext) -> list[float]:
        """Each micro-batch's mean token loss, without backward (validation)."""
        return plain_forward_losses(model, micro_batches, autocast)

    def sum_stats(self, values: torch.Tensor) -> torch.Tensor:
        """A step's packed statistics summed over every process of the job, in one collective (here: itself).
        `values` is a 1-D float64 tensor on any device; the sum stays there (the caller copies it to the host
        without waiting: megaloop.model.transfer.HostCopy)."""
        return values.detach().to(dtype=torch.float64)

    def world_max(self, value: float) -> float:
        return value

    def all_gather_object(self, obj) -> list:
        return [obj]

    def gather_object(self, obj, dst: int = 0) -> list:
        return [obj]

    def scatter_object(self, objs: list, src: int = 0):
        return objs[0]

    tp_rank = 0

    def shard_spec(self, name: str):
        """Every parameter is whole in one process."""
        return None

    def describe_layout(self) -> dict:
        return {"world_size": 1, "tp": 1, "pp": 1, "dp": 1, "engine": "native", "zero_stage": 0}

    def barrier(self) -> None:
        return None

    def close(self) -> None:
        return None


def set_phase_timeout(runtime: TrainerRuntime, seconds: float) -> None:
    """Every process group of the runtime times out after `seconds` from now on: parallel.timeout_s while steps
    run, parallel.startup_timeout_s during start-up and checkpoint saves (pipeline.layout.init_layout)."""
    if runtime.layout is not None:
        from pipeline.layout import set_group_timeouts

        set_group_timeouts(runtime.layout, seconds)


@contextlib.contextmanager
def phase_timeout(runtime: TrainerRuntime, seconds: float, then: float):
    """set_phase_timeout(seconds) for the block, then `then` (a save inside the steps)."""
    set_phase_timeout(runtime, seconds)
    try:
        yield
    finally:
        set_phase_timeout(runtime, then)


def make_runtime(cfg, device: torch.device) -> TrainerRuntime:
    """The runtime for this job: single-process, or pipeline's tensor/data-parallel one (native or DeepSpeed), or
    its ring-pipeline one (pp > 1), when launched on several processes (torchrun or Slurm), built from cfg.parallel
    with megaloop's TP plan, per-matrix Muon functions and stage functions (pipeline never imports megaloop)."""
    from pipeline.layout import BatchDims, ModelDims, init_layout, read_launch_env

    if read_launch_env().world_size == 1:
        if cfg.parallel.dp not in (None, 1):  # nothing would run in parallel, yet the run would be recorded as dp > 1
            from megaloop.config import ConfigError

            raise ConfigError("parallel.dp", cfg.parallel.dp, "this is a single process (not started by torchrun or "
                              f"Slurm): launch {cfg.parallel.dp * cfg.parallel.tp} processes, e.g. `torchrun "
                              f"--standalone --nproc-per-node {cfg.parallel.dp * cfg.parallel.tp} -m megaloop train "
                              "...`, or set parallel.dp=null to train in this one process")
        if cfg.parallel.tp == 1 and cfg.parallel.pp == 1:
            return SingleProcessRuntime(device)
    m, p, d = cfg.model, cfg.parallel, cfg.data
    layout = init_layout(tp=p.tp, pp=p.pp, dp=p.dp, model=ModelDims(m.n_heads, m.kv_heads, m.vocab_size, m.seq_len),
                         batch=BatchDims(d.global_batch_size, d.micro_batch_size),
                         sequence_parallel=p.sequence_parallel, device=device.type, backend=p.backend,
                         timeout_s=p.timeout_s, startup_timeout_s=p.startup_timeout_s)
    if p.engine == "deepspeed":
        from pipeline.deepspeed_engine import DeepSpeedRuntime

        return DeepSpeedRuntime(layout, p.zero_stage, d.micro_batch_size,
                                d.global_batch_size // (layout.dp * d.micro_batch_size), offload=p.zero_offload,
                                bf16=False)
    from megaloop.model.tp_plan import tensor_parallel_plan
    from megaloop.optim import muon
    from pipeline.dist_muon import MuonFunctions
    from pipeline.runtime import ParallelRuntime

    functions = MuonFunctions(init_state=muon.init_muon_state, hparams=muon.MuonHParams, update=muon.muon_update,
                              apply=muon.apply_muon_update, lr_scale=muon.muon_lr_scale)
    if p.pp > 1:
        from megaloop.model.stages import LoopedStageProgram, stage_parameter_names
        from pipeline.pipeline_runtime import PipelineRuntime, StageFunctions

        split = p.pp_split
        stages = StageFunctions(parameter_names=functools.partial(stage_parameter_names, split=split),
                                program=functools.partial(LoopedStageProgram, split=split,
                                                          message_dtype=message_dtype(cfg)))
        return PipelineRuntime(layout, tensor_parallel_plan(m.mlp), functions, stages, zero_stage=p.zero_stage,
                               grad_reduce_dtype=p.grad_reduce_dtype, in_flight=p.pp_in_flight,
                               p2p_semantics=p.p2p_semantics, timeout_s=p.timeout_s,
                               bucket_elements=p.grad_bucket_elements, overlap_param_gather=p.overlap_param_gather,
                               grad_buckets=p.grad_buckets)
    return ParallelRuntime(layout, tensor_parallel_plan(m.mlp), functions, zero_stage=p.zero_stage,
                           grad_reduce_dtype=p.grad_reduce_dtype, bucket_elements=p.grad_bucket_elements,
                           overlap_param_gather=p.overlap_param_gather, grad_buckets=p.grad_buckets)


MESSAGE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}


def message_dtype(cfg) -> torch.dtype | None:
    """The dtype of the ring pipeline's messages: parallel.pp_message_dtype, else the compute dtype of
    train.precision (None where that is not concrete yet: the stage program then uses its parameters' dtype)."""
    if cfg.parallel.pp_message_dtype is not None:
        return MESSAGE_DTYPES[cfg.parallel.pp_message_dtype]
    return COMPUTE_DTYPES.get(cfg.train.precision)
