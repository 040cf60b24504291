"""The multi-process runtime the trainer talks to (same methods as megaloop's SingleProcessRuntime).

    runtime = ParallelRuntime(layout, tp_plan, muon_functions, zero_stage=1)
    model = runtime.prepare_model(model)                 # tensor parallelism (plan) + data-parallel reducer
    optimizer = runtime.prepare_optimizer(build_optimizer(model.named_parameters(), ...,
                                          norm_sq_reduce=runtime.norm_sq_reduce()))
    ... loss.backward() per micro-batch ...
    runtime.reduce_gradients(model)                      # dp sum (bucketed) + tp sum of sequence-parallel partials
    optimizer.step(step)                                 # global clip, distributed Muon, ZeRO-1 AdamW
    runtime.sum_over_dp(x) / mean_over_dp(x)             # logged metrics

prepare_optimizer expects an optimizer shaped like megaloop's CombinedOptimizer (attributes muon, adamw,
muon_names, adamw_names; it schedules, clips and skips) and swaps its inner Muon for :class:`DistributedMuon` (always
under tensor parallelism, where a shard cannot be orthogonalised alone, and under ZeRO with dp > 1) and its AdamW
for :class:`ZeroAdamW` (ZeRO stage >= 1 with dp > 1). The per-matrix Muon math comes in as `muon_functions`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from pipeline.collectives import all_reduce_
from pipeline.data_parallel import DEFAULT_BUCKET_MB, GradReducer
from pipeline.dist_muon import DistributedMuon, MuonFunctions
from pipeline.grad_norm import make_norm_sq_reduce
from pipeline.layout import ParallelLayout, destroy_layout
from pipeline.parallel_lm import ParallelLM
from pipeline.tensor_parallel import TensorParallelInfo, reduce_partial_grads
from pipeline.zero import ZeroAdamW


class ParallelRuntime:
    """Tensor + data parallelism for the trainer; see the module docstring."""

    def __init__(self, layout: ParallelLayout, tp_plan, muon_functions: MuonFunctions | None = None,
                 zero_stage: int = 1, bucket_mb: float = DEFAULT_BUCKET_MB):
        if layout.pp > 1:
            raise NotImplementedError("pipeline parallelism (pp > 1) is a later step; use tp and dp for now")
        if zero_stage not in (0, 1):
            raise ValueError(f"the native engine implements ZeRO stages 0 and 1, not {zero_stage}; use "
                             "parallel.engine=deepspeed for ZeRO 2/3")
        self.layout = layout
        self.tp_plan = tp_plan
        self.muon_functions = muon_functions
        self.zero_stage = zero_stage
        self.bucket_mb = bucket_mb
        self.model: torch.nn.Module | None = None
        self.tp_info = TensorParallelInfo()
        self.reducer: GradReducer | None = None

    # ---- identity of this rank ------------------------------------------------------------------------------
    rank = property(lambda self: self.layout.rank)
    world_size = property(lambda self: self.layout.world_size)
    dp_rank = property(lambda self: self.layout.dp_rank)
    dp_size = property(lambda self: self.layout.dp)
    is_main = property(lambda self: self.layout.rank == 0)
    device = property(lambda self: self.layout.device)

    # ---- model and gradients --------------------------------------------------------------------------------
    def prepare_model(self, model: torch.nn.Module):
        """Split the model by the plan (tp > 1) and attach the data-parallel reducer; returns what to call."""
        self.model = model
        wrapped = model
        if self.layout.tp > 1:
            wrapped = ParallelLM(model, self.layout, self.tp_plan)
            self.tp_info = wrapped.tp_info
        else:
            self.tp_info = TensorParallelInfo(replicated=[n for n, _ in model.named_parameters()])
        self.reducer = GradReducer(list(model.parameters()), self.layout.dp_group, self.bucket_mb)
        return wrapped

    def backward(self, loss: torch.Tensor) -> None:
        """One micro-batch's backward (the DeepSpeed runtime routes it through its engine)."""
        loss.backward()

    def overlap_next_backward(self) -> None:
        """Reduce gradient buckets during the coming backward; call just before the step's last backward."""
        self.reducer.overlap_next_backward()

    def reduce_gradients(self, model=None) -> None:
        """After the step's last backward: sum gradients over dp, and sequence-parallel partials over tp."""
        self.reducer.reduce()
        reduce_partial_grads(self.model, self.tp_info, self.layout.tp_group)

    def norm_sq_reduce(self):
        """The clip's reduction of the squared gradient norm over tp and pp (None when nothing is split)."""
        if self.layout.tp == 1 and self.layout.pp == 1:
            return None
        return make_norm_sq_reduce(self.model, list(self.tp_info.shards), self.layout)

    # ---- optimizer ------------------------------------------------------------------------------------------
    def prepare_optimizer(self, optimizer):
        """Swap the combined optimizer's inner Muon/AdamW for the distributed ones where needed; returns it."""
        dp_sharded = self.zero_stage >= 1 and self.layout.dp > 1
        muon = getattr(optimizer, "muon", None)
        if muon is not None and (self.layout.tp > 1 or dp_sharded):
            if self.muon_functions is None:
                raise ValueError("distributed Muon needs the per-matrix functions (muon_functions)")
            named = list(zip(optimizer.muon_names, muon.param_groups[0]["params"]))
            hyper = {k: v for k, v in muon.param_groups[0].items() if k != "params"}
            optimizer.muon = DistributedMuon(named, self.layout, self.tp_info.shards, self.muon_functions,
                                             orth_dtype=getattr(muon, "orth_dtype", torch.bfloat16), **hyper)
        adamw = getattr(optimizer, "adamw", None)
        if adamw is not None and dp_sharded:
            g = adamw.param_groups[0]
            optimizer.adamw = ZeroAdamW(g["params"], self.layout.dp_group, lr=g["lr"], betas=g["betas"],
                                        eps=g["eps"], weight_decay=g["weight_decay"], fused=g.get("fused"),
                                        names=optimizer.adamw_names)
        return optimizer

    # ---- metrics and lifecycle ------------------------------------------------------------------------------
    def sum_over_dp(self, value: float) -> float:
        if self.layout.dp_group is None:
            return value
        t = torch.tensor([float(value)], dtype=torch.float64, device=self._comm_device())
        return float(all_reduce_(t, self.layout.dp_group)[0])

    def mean_over_dp(self, value: float) -> float:
        return self.sum_over_dp(value) / self.layout.dp

    tp_size = property(lambda self: self.layout.tp)

    def sum_stats(self, values: torch.Tensor) -> torch.Tensor:
        """A step's packed statistics (1-D float64) summed over every process of the job in ONE all-reduce; the
        caller divides what tensor-parallel ranks hold identically by tp_size. The sum comes back on the CPU."""
        t = values.detach().to(self._comm_device(), torch.float64)
        if dist.is_initialized():
            dist.all_reduce(t)
        return t.cpu()

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

    # ---- layout facts for layout-free checkpoints ------------------------------------------------------------
    tp_rank = property(lambda self: self.layout.tp_rank)

    def shard_spec(self, name: str):
        """How parameter `name` is split over tp (a ShardSpec), or None when this rank holds it whole."""
        return self.tp_info.shards.get(name) if self.layout.tp > 1 else None

    def describe_layout(self) -> dict:
        return {"world_size": self.layout.world_size, "tp": self.layout.tp, "pp": self.layout.pp,
                "dp": self.layout.dp, "engine": "native", "zero_stage": self.zero_stage}

    def _comm_device(self) -> torch.device:
        return self.layout.device if self.layout.backend == "nccl" else torch.device("cpu")

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def close(self) -> None:
        if self.reducer is not None:
            self.reducer.remove_hooks()
        destroy_layout()
