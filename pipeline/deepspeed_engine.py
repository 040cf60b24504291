"""DeepSpeed as an alternative data-parallel engine (parallel.engine: deepspeed) for AdamW configurations.

ZeRO stage 1, 2 or 3, optionally with the optimizer state offloaded to the CPU, over the dp group; tensor and
pipeline parallelism stay with the native engine (tp = pp = 1 here). The optimizer is torch's AdamW inside DeepSpeed
(optimizer params {"torch_adam": true}: no compiled Adam kernels needed, DS_BUILD_OPS=0 installs suffice).

Muon does not run under this engine: ZeRO partitions the flattened parameters by elements (stage 1/2: the
optimizer's view of a matrix is a slice of a flat buffer; stage 3: the parameter itself), so no rank holds a whole
matrix to orthogonalise. Use the native engine (distributed Muon with per-matrix owners) for optim.name=muon.

Semantics match the native engine: the trainer scales each micro-batch loss by its share of the global token count
and expects the gradients SUMMED over dp, while DeepSpeed averages over dp and divides by the accumulation steps;
`backward` therefore multiplies the loss by dp and asks DeepSpeed not to rescale by the accumulation steps.

DeepSpeed's communication layer loads a small shared-memory op that torch JIT-compiles with g++ and ninja on first
use. scripts/setup.sh builds it once into the virtual environment (`op_cache_dir()`); this module points
TORCH_EXTENSIONS_DIR there (unless it is set) before DeepSpeed starts, so every process finds that build.
"""
from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.runtime import ParallelRuntime

MUON_UNSUPPORTED = ("optim.name=muon cannot run under parallel.engine=deepspeed: ZeRO partitions parameters by "
                    "elements, so no rank holds a whole matrix for Muon's orthogonalisation; use "
                    "parallel.engine=native (distributed Muon) or optim.name=adamw")


def deepspeed_config(zero_stage: int, micro_batch: int, grad_accum: int, dp: int, lr: float, betas, eps: float,
                     weight_decay: float, grad_clip: float, offload: bool = False, bf16: bool = False) -> dict:
    """The DeepSpeed JSON config for these settings."""
    if zero_stage not in (1, 2, 3):
        raise ValueError(f"parallel.zero_stage={zero_stage}: DeepSpeed runs ZeRO stages 1, 2, 3")
    zero: dict[str, Any] = {"stage": zero_stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": micro_batch * grad_accum * dp,
        "gradient_clipping": grad_clip,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": list(betas), "eps": eps,
                                                  "weight_decay": weight_decay, "torch_adam": True}},
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


@dataclass(frozen=True)
class EngineStepRecord:
    """The fields of the native optimizer's step record that the trainer logs."""

    step: int
    grad_norm: float
    skipped: bool
    lr_multiplier: float
    matrix_lr: float
    adam_lr: float
    muon_momentum: float
    muon_weight_decay: float


ZERO3_UNEQUAL_LOOPS = ("DeepSpeed ZeRO-3 gathers a partitioned weight at every call of its module, so every "
                       "data-parallel rank must run the same number of loop steps per micro-batch; this rank runs "
                       "{mine} (no-grad, grad) steps but another runs {other}. Use a per-batch depth sampler "
                       "(model.depth_sampler=poisson-truncated-full-batch or fixed), ZeRO stage 1/2, or the native "
                       "engine")


def loop_steps(depth, backprop_depth, batch: int) -> tuple[int, int]:
    """(no-grad steps, grad steps) the loop runs for a micro-batch: max over sequences of T - k and of k."""
    total = torch.as_tensor(depth if depth is not None else 1).reshape(-1).expand(batch)
    grad = total if backprop_depth is None else torch.minimum(
        total, torch.as_tensor(backprop_depth).reshape(-1).expand(batch))
    return int((total - grad).max()), int(grad.max())


class DeepSpeedModel:
    """Stands for the model until the engine exists (the optimizer's hyperparameters are needed to build it),
    then forwards calls to the engine; parameters and modes are the model's own. Under ZeRO-3 each call first
    checks (one tiny all-reduce) that every dp rank runs the same number of loop steps, and fails with an
    explanation instead of a collective mismatch; `comm_device` is where that all-reduce's tensor lives (the GPU
    under NCCL, the CPU under gloo)."""

    def __init__(self, model: torch.nn.Module, dp_group=None, check_equal_loops: bool = False,
                 comm_device: torch.device | str = "cpu"):
        self.model = model
        self.engine = None
        self.dp_group = dp_group
        self.check_equal_loops = check_equal_loops
        self.comm_device = comm_device

    def __getattr__(self, name: str):
        return getattr(self.__dict__["model"], name)

    def __call__(self, *args, **kwargs):
        if self.engine is None:
            raise RuntimeError("call runtime.prepare_optimizer(...) before running the model under DeepSpeed")
        if self.check_equal_loops and self.dp_group is not None:
            self._check_equal_loops(args[0].shape[0], kwargs.get("depth"), kwargs.get("backprop_depth"))
        return self.engine(*args, **kwargs)

    def _check_equal_loops(self, batch: int, depth, backprop_depth) -> None:
        mine = loop_steps(depth, backprop_depth, batch)
        both = torch.tensor([*mine, *(-v for v in mine)], dtype=torch.float64, device=self.comm_device)
        torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX, group=self.dp_group)
        high, low = (int(both[0]), int(both[1])), (int(-both[2]), int(-both[3]))
        if high != low:
            raise RuntimeError(ZERO3_UNEQUAL_LOOPS.format(mine=mine, other=high if high != mine else low))


class DeepSpeedOptimizer:
    """The engine's optimizer behind the combined optimizer's interface: step(step) applies the schedule's AdamW
    learning rate, lets DeepSpeed clip (global norm over dp partitions) and step, and returns a record."""

    def __init__(self, engine, combined):
        self.engine = engine
        self.combined = combined
        self.num_skipped = 0
        self.iteration = 0

    def step(self, step: int | None = None) -> EngineStepRecord:
        step = self.iteration if step is None else step
        values = self.combined.schedule_at(step)
        for group in self.engine.optimizer.param_groups:
            group["lr"] = values.adam_lr
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        self.iteration = step + 1
        return EngineStepRecord(step, float(norm) if norm is not None else float("nan"), False,
                                values.lr_multiplier, values.matrix_lr, values.adam_lr, values.muon_momentum,
                                values.muon_weight_decay)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()


def op_cache_dir() -> Path:
    """Where DeepSpeed's JIT-compiled ops live: inside the running virtual environment (built for its torch)."""
    return Path(sys.prefix) / "torch_extensions"


def use_op_cache() -> None:
    """Point torch's extension builds at op_cache_dir() unless TORCH_EXTENSIONS_DIR is set, and put the
    environment's own ninja (a DeepSpeed dependency) on PATH when none is there: torch calls `ninja` by name."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(op_cache_dir()))
    scripts = Path(sys.executable).parent
    if shutil.which("ninja") is None and (scripts / "ninja").exists():
        os.environ["PATH"] = f"{scripts}{os.pathsep}{os.environ.get('PATH', '')}"


def build_comm_op() -> str:
    """Build (or find already built) the shared-memory comm op that DeepSpeed's communication layer loads on this
    accelerator, in the cache; says where. Fails with the compiler's message when g++ or ninja is missing."""
    use_op_cache()
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return f"not used on this accelerator ({get_accelerator().device_name()})"
    builder.load()
    return f"ready in {os.environ['TORCH_EXTENSIONS_DIR']}"


def initialize_engine(model: torch.nn.Module, config: dict, dp_group=None):
    """deepspeed.initialize on an already started torch.distributed (gloo on CPU, NCCL on GPU)."""
    use_op_cache()
    import deepspeed

    deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(), auto_mpi_discovery=False)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                          if p.requires_grad], config=config)
    return engine


class DeepSpeedRuntime(ParallelRuntime):
    """The trainer's runtime with DeepSpeed doing data parallelism and the optimizer step. The trainer calls
    runtime.backward(loss) for each micro-batch (DeepSpeed's backward hooks reduce and partition gradients) and
    optimizer.step(step) once per global step; micro_batches_per_step tells which backward closes the step."""

    def __init__(self, layout, zero_stage: int, micro_batch: int, micro_batches_per_step: int,
                 offload: bool = False, bf16: bool = False):
        if layout.tp > 1 or layout.pp > 1:
            raise ValueError("parallel.engine=deepspeed runs data parallelism only (tp = pp = 1); use "
                             "parallel.engine=native for tensor parallelism")
        super().__init__(layout, tp_plan=(), zero_stage=0)
        self.zero_stage = zero_stage
        self.micro_batch = micro_batch
        self.micro_batches_per_step = micro_batches_per_step
        self.offload, self.bf16 = offload, bf16
        self.proxy: DeepSpeedModel | None = None
        self._backwards = 0

    def prepare_model(self, model: torch.nn.Module, materialize=None):
        """The model behind DeepSpeed's engine (made in prepare_optimizer); materialize(model, None), when given,
        fills it first (nothing is split: tp = 1)."""
        if materialize is not None:
            materialize(model, None)
        self.model = model
        self.proxy = DeepSpeedModel(model, self.layout.dp_group, check_equal_loops=self.zero_stage == 3,
                                    comm_device=self._comm_device())
        return self.proxy

    def prepare_optimizer(self, optimizer):
        """Build the engine from the combined optimizer's AdamW group (Muon: error, see module docstring)."""
        if getattr(optimizer, "muon", None) is not None:
            raise ValueError(MUON_UNSUPPORTED)
        g = optimizer.adamw.param_groups[0]
        config = deepspeed_config(self.zero_stage, self.micro_batch, self.micro_batches_per_step, self.layout.dp,
                                  g["lr"], g["betas"], g["eps"], g["weight_decay"], optimizer.cfg.grad_clip,
                                  self.offload, self.bf16)
        self.proxy.engine = initialize_engine(self.model, config)
        return DeepSpeedOptimizer(self.proxy.engine, optimizer)

    def backward(self, loss: torch.Tensor) -> None:
        """DeepSpeed's backward; the loss (already a share of the global token mean) times dp, so DeepSpeed's
        average over dp becomes the sum the trainer expects; the last micro-batch of a step is the boundary."""
        engine = self.proxy.engine
        self._backwards += 1
        engine.set_gradient_accumulation_boundary(self._backwards == self.micro_batches_per_step)
        engine.backward(loss * self.layout.dp, scale_wrt_gas=False)
        if self._backwards == self.micro_batches_per_step:
            self._backwards = 0

    def overlap_next_backward(self) -> None:
        """Nothing: DeepSpeed overlaps its own reduction with the backward (its gradient hooks)."""

    def reduce_gradients(self, model=None) -> None:
        """Nothing: DeepSpeed reduced the gradients in its backward."""

    def optimizer_parts(self):
        """None: DeepSpeed partitions and steps the optimizer itself (see prepare_optimizer)."""
        return None

    def close(self) -> None:
        self.proxy = None  # the engine holds the data-parallel group
        super().close()
