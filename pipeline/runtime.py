"""The multi-process runtime the trainer talks to (the members of megaloop's TrainerRuntime protocol, provided
structurally: pipeline never imports megaloop).

    runtime = ParallelRuntime(layout, tp_plan, muon_functions, zero_stage=1, grad_reduce_dtype="fp32")
    model = runtime.prepare_model(model)                 # tensor parallelism (plan); the gradient buffer waits
    optimizer = build_optimizer(model.named_parameters(), ..., parts=runtime.optimizer_parts())
    runtime.run_micro_batches(model, micro_batches, scales)  # forward + backward of each (pipeline/micro_batches.py)
    runtime.reduce_gradients(model)                      # dp reduce-scatter (ZeRO-1) or all-reduce + tp partials
    optimizer.step(step)                                 # global clip, distributed Muon, ZeRO-1 AdamW, all-gather
    runtime.sum_over_dp(x) / mean_over_dp(x)             # logged metrics

Gradients live in a :class:`GradBuffer` (every .grad a view of one flat vector per dtype). The optimizer built with
:meth:`ParallelRuntime.optimizer_parts` lays out the chunked one it updates (see pipeline/optimizer_parts.py).
Without one, a plain buffer (one chunk, all-reduced) is laid out when gradients first need it (the first
runtime.backward, overlap_next_backward, reduce_gradients, or reading runtime.buffer / runtime.reducer): prepare_model
only records the parameters, so the trainer copies its parameters into one flat buffer, never two at once.
The per-matrix Muon math comes in as `muon_functions` (pipeline never imports megaloop).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from pipeline.collectives import all_reduce_
from pipeline.data_parallel import BufferReducer
from pipeline.dist_muon import MuonFunctions
from pipeline.grad_buffer import GradBuffer, flat_all_reduce_, gradient_order
from pipeline.groups import GroupStats
from pipeline.layout import ParallelLayout, destroy_layout
from pipeline.micro_batches import plain_forward_losses, run_micro_batches
from pipeline.optimizer_parts import OptimizerParts
from pipeline.parallel_lm import ParallelLM
from pipeline.tensor_parallel import TensorParallelInfo


class ParallelRuntime:
    """Tensor + data parallelism for the trainer; see the module docstring. pp > 1: pipeline.pipeline_runtime."""

    runs_pipeline = False
    plans_ahead = False  # plan_ahead does nothing (a pipeline runtime makes its ring schedules ahead)
    layout: ParallelLayout

    def __init__(self, layout: ParallelLayout, tp_plan, muon_functions: MuonFunctions | None = None,
                 zero_stage: int = 1, bucket_elements: int | None = None, grad_reduce_dtype: str = "fp32",
                 overlap_param_gather: bool = True, grad_buckets: str = "backward"):
        if layout.pp > 1 and not self.runs_pipeline:
            raise ValueError("a layout with pp > 1 runs on pipeline.pipeline_runtime.PipelineRuntime")
        if zero_stage not in (0, 1):
            raise ValueError(f"the native engine implements ZeRO stages 0 and 1, not {zero_stage}; use "
                             "parallel.engine=deepspeed for ZeRO 2/3")
        self.layout = layout
        self.tp_plan = tp_plan
        self.muon_functions = muon_functions
        self.zero_stage = zero_stage
        self.bucket_elements = bucket_elements  # None: max(40M, 1M x dp) (pipeline.data_parallel)
        self.overlap_param_gather = overlap_param_gather
        self.grad_reduce_dtype = grad_reduce_dtype
        self.grad_buckets = grad_buckets  # the gradient buffer's layout (pipeline.grad_buffer.LAYOUTS)
        self.model: torch.nn.Module | None = None
        self.tp_info = TensorParallelInfo()
        self._buffer: GradBuffer | None = None
        self._reducer: BufferReducer | None = None
        self._deferred: list | None = None  # (name, parameter) of the plain buffer not laid out yet
        self._deferred_late: set[str] = set()
        self._parts: OptimizerParts | None = None

    # ---- identity of this rank ------------------------------------------------------------------------------
    rank = property(lambda self: self.layout.rank)
    world_size = property(lambda self: self.layout.world_size)
    dp_rank = property(lambda self: self.layout.dp_rank)
    dp_size = property(lambda self: self.layout.dp)
    is_main = property(lambda self: self.layout.rank == 0)
    device = property(lambda self: self.layout.device)

    # ---- model and gradients --------------------------------------------------------------------------------
    pp_size = 1

    def held_parameter_names(self, model) -> list[str]:
        """The parameters this rank holds (pieces of, under tp): all of them without pipeline parallelism."""
        return [name for name, _ in model.named_parameters()]

    def uncounted_names(self) -> set[str]:
        """Parameters whose gradient this rank leaves out of the global norm (another rank counts them): none."""
        return set()

    def prepare_model(self, model: torch.nn.Module, materialize=None):
        """Split the model by the plan (tp > 1) and defer a plain (all-reduced) gradient buffer for its parameters
        (see defer_buffer); returns what to call.

        materialize(model, tp_info), when given, runs right after the split: for a model built on
        the meta device, it allocates and initialises what this rank holds (its shards, the replicated parameters),
        so no rank ever allocates a whole split parameter set (megaloop's trainer passes one)."""
        self.model = model
        wrapped = model
        if self.layout.tp > 1:
            wrapped = ParallelLM(model, self.layout, self.tp_plan)
            self.tp_info = wrapped.tp_info
        else:
            self.tp_info = TensorParallelInfo(replicated=[n for n, _ in model.named_parameters()])
        if materialize is not None:
            materialize(model, self.tp_info)
        self.defer_buffer(list(model.named_parameters()))
        return wrapped

    def gradient_order(self, named) -> tuple[list, set[str]]:
        """`named` in the order backward finishes their gradients and the names finished last (the lookups'),
        as the buffer's layout wants them (pipeline/grad_buffer.py); "columns" keeps the given order."""
        if self.grad_buckets == "columns" or self.model is None:
            return list(named), set()
        return gradient_order(self.model, list(named))

    def defer_buffer(self, named_params) -> None:
        """Reduce the gradients of `named_params` (name, parameter) through a plain buffer (one chunk, all-reduced)
        laid out only when gradients first need it, unless an optimizer's buffer (use_buffer) comes first: laying
        it out copies every parameter into a flat vector, which the optimizer's chunked buffer would copy again."""
        self._drop_reducer()
        self._deferred, self._deferred_late = self.gradient_order(named_params)
        if self.grad_buckets == "columns":
            self._deferred = self._deferred[::-1]  # the earlier layout's order: backward's, roughly
        self._buffer = None

    def use_buffer(self, buffer: GradBuffer) -> None:
        """Reduce gradients through `buffer` from now on (reduce-scatter when it is chunked over dp); a deferred
        plain buffer is never laid out."""
        self._drop_reducer()
        self._buffer, self._deferred = buffer, None
        group = self.layout.dp_group if self.layout.dp > 1 else None
        self._reducer = BufferReducer(buffer, group, self.bucket_elements, self.grad_reduce_dtype)

    @property
    def buffer(self) -> GradBuffer | None:
        """The gradient buffer (the deferred plain one is laid out now if no other came first); None before
        prepare_model."""
        self._lay_out_deferred()
        return self._buffer

    @property
    def reducer(self) -> BufferReducer | None:
        """The data-parallel reducer of :attr:`buffer` (laid out as there)."""
        self._lay_out_deferred()
        return self._reducer

    def _lay_out_deferred(self) -> None:
        if self._deferred is not None:
            # copies any gradient accumulated so far
            self.use_buffer(GradBuffer(self._deferred, late=self._deferred_late, layout=self.grad_buckets))

    def _drop_reducer(self) -> None:
        if self._reducer is not None:
            self._reducer.remove_hooks()
        self._reducer = None

    def run_micro_batches(self, model, micro_batches, scales, autocast=contextlib.nullcontext, timer=None) -> list:
        """A step's micro-batches, forward and backward each in order (loss times its scale, the last backward
        overlapped with the gradient reduction); the per-micro-batch results (pipeline.micro_batches). The DeepSpeed
        runtime inherits it: its backward goes through the engine."""
        return run_micro_batches(self, model, micro_batches, scales, autocast, timer)

    def plan_ahead(self, model, micro_batches) -> None:
        """Nothing: the micro-batches run as a plain loop, with no schedule to make ahead."""
        return None

    def forward_losses(self, model, micro_batches, autocast=contextlib.nullcontext) -> list[float]:
        """Each micro-batch's mean token loss, without backward (validation)."""
        self.finish_param_gather()
        return plain_forward_losses(model, micro_batches, autocast)

    def backward(self, loss: torch.Tensor) -> None:
        """One micro-batch's backward into the gradient buffer (the DeepSpeed runtime routes it through its
        engine). The parameter all-gather still in flight is finished first: the reduction's collectives follow
        it on the same group, in the same order on every rank."""
        self._lay_out_deferred()
        self.finish_param_gather()
        loss.backward()

    def finish_param_gather(self) -> None:
        """Wait for the overlapped ZeRO-1 parameter all-gather (pipeline/param_gather.py), if one is in flight:
        before reading parameters outside a forward (checkpoint saves) and before other collectives of the group."""
        if self._parts is not None:
            self._parts.finish_update()

    def overlap_next_backward(self) -> None:
        """Reduce gradient buckets during the coming backward; call just before the step's last backward."""
        self.reducer.overlap_next_backward()

    def reduce_gradients(self, model=None) -> None:
        """After the step's last backward: sum gradients over dp (this rank's chunk under ZeRO-1, everything
        otherwise), then the sequence-parallel partial sums over tp of what this rank holds summed."""
        self.reducer.reduce()
        flat_all_reduce_(self.buffer.owned_grad_views(self.tp_info.partial_grad), self.layout.tp_group)

    # ---- optimizer ------------------------------------------------------------------------------------------
    def optimizer_parts(self) -> OptimizerParts:
        """The distributed Muon/AdamW and gradient buffer to build the combined optimizer with (once)."""
        if self.model is None:
            raise RuntimeError("call runtime.prepare_model(model) before runtime.optimizer_parts()")
        self._parts = OptimizerParts(self)
        return self._parts

    def prepare_optimizer(self, optimizer):
        """Check that the optimizer was built with this runtime's parts (its gradients are reduced through their
        buffer); returns it."""
        parts = getattr(optimizer, "parts", None)
        if parts is None or parts is not self._parts:
            raise ValueError("the optimizer was not built with this runtime's distributed parts: build it with "
                             "build_optimizer(..., parts=runtime.optimizer_parts())")
        return optimizer

    # ---- metrics and lifecycle ------------------------------------------------------------------------------
    def sum_over_dp(self, value: float) -> float:
        if self.layout.dp_group is None:
            return value
        t = torch.tensor([float(value)], dtype=torch.float64, device=self._comm_device())
        return float(all_reduce_(t, self.layout.dp_group)[0])

    tp_size = property(lambda self: self.layout.tp)

    def sum_stats(self, values: torch.Tensor) -> torch.Tensor:
        """A step's packed statistics (1-D float64) summed over every process of the job in ONE all-reduce; the
        caller divides what tensor-parallel ranks hold identically by tp_size. The sum stays on the communication
        device (the caller brings it to the host without waiting, after later work is queued)."""
        t = values.detach().to(self._comm_device(), torch.float64)
        if dist.is_initialized():
            dist.all_reduce(t)
        return t

    def world_max(self, value: float) -> float:
        """The maximum of `value` over every rank of the job (the agreed stop, checkpoint verification)."""
        if not dist.is_initialized():
            return value
        t = torch.tensor([float(value)], dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t[0])

    def all_gather_object(self, obj) -> list:
        """Every rank's `obj`, in rank order (small, picklable objects made by this job's own processes)."""
        if not dist.is_initialized():
            return [obj]
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def gather_object(self, obj, dst: int = 0) -> list | None:
        """Every rank's `obj` on rank `dst` (rank order), None on the others: only `dst` holds them all."""
        if not dist.is_initialized():
            return [obj]
        out = [None] * dist.get_world_size() if dist.get_rank() == dst else None
        dist.gather_object(obj, out, dst=dst)
        return out

    def scatter_object(self, objs: list | None, src: int = 0):
        """objs[r] (the list rank `src` gives; the others pass None) on each rank r."""
        if not dist.is_initialized():
            return objs[0]
        out = [None]
        dist.scatter_object_list(out, objs if dist.get_rank() == src else None, src=src)
        return out[0]

    # ---- layout facts for layout-free checkpoints ------------------------------------------------------------
    tp_rank = property(lambda self: self.layout.tp_rank)

    def shard_spec(self, name: str):
        """How parameter `name` is split over tp (a ShardSpec), or None when this rank holds it whole."""
        return self.tp_info.shards.get(name) if self.layout.tp > 1 else None

    def describe_layout(self) -> dict:
        return {"world_size": self.layout.world_size, "tp": self.layout.tp, "pp": self.layout.pp,
                "dp": self.layout.dp, "engine": "native", "zero_stage": self.zero_stage,
                "process_groups": self.group_stats().as_dict()}

    def group_stats(self) -> GroupStats:
        """What creating this job's process groups cost (pipeline.groups): the layout's groups."""
        return self.layout.group_stats

    def _comm_device(self) -> torch.device:
        return self.layout.comm_device

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def close(self) -> None:
        """End of the job: drop every reference this runtime holds to a process group (its layout keeps the rank
        facts only), then tear the groups down (see destroy_layout). The caller frees the model and optimizer
        first: tensor-parallel layers and distributed optimizers hold groups too."""
        self._drop_reducer()
        if self._parts is not None and self._parts.gather is not None:
            self._parts.gather.detach()
        self.model = self._buffer = self._deferred = self._parts = None
        self.tp_info = TensorParallelInfo()
        self.layout = self.layout.without_groups()
        destroy_layout()
