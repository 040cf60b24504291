"""The distributed parts that megaloop's combined optimizer is built with under the native engine.

The combined optimizer (megaloop) keeps the schedules, clipping, skipping and step records; these parts supply
what depends on the layout:

- :meth:`OptimizerParts.build` makes the distributed Muon and the ZeRO AdamW for the two parameter groups, lays out
  the :class:`GradBuffer` (in the order backward finishes the gradients: each Muon matrix whole in its owner's
  chunk, the embeddings in groups of their own; pipeline/grad_buffer.py) and hands it to the runtime's reducer
  (reduce-scatter under ZeRO-1 with dp > 1, all-reduce under stage 0);
- :meth:`grads_to_clip` gives the gradient pieces this rank holds summed (its chunk) and :meth:`norm_sq_reduce`
  turns their sum of squares into the global one: one scalar all-reduce over dp, then tp and pp, with parameters
  replicated over tp counted on tp rank 0 only;
- :meth:`begin_update` / :meth:`end_update` bracket the inner steps: end_update runs the all-gather per dtype of
  the updated chunks (one call while a gradient bucket holds a whole chunk, else one per bucket-sized column range;
  pipeline/param_gather.py). With gradient reduction in fp32 it carries the new parameters (exact); in bf16 it
  carries the updates (new - old) in bf16, which every rank, the owner included, adds to its old values, so
  replicas stay bit-identical while the all-gather moves half the bytes. With the runtime's overlap_param_gather
  (the default) end_update only launches the first buckets: the next forward waits for each bucket just before
  its first module that uses it, and :meth:`finish_update` waits for the rest (the runtime calls it before the
  first backward, evaluation and checkpoint saves; begin_update calls it too);
- :meth:`zero_grad` zeroes the buffer in place (the .grad views stay attached).
"""
from __future__ import annotations

import torch

from pipeline.dist_muon import DistributedMuon
from pipeline.grad_buffer import GradBuffer
from pipeline.grad_norm import counted_grad_views, reduce_norm_sq
from pipeline.param_gather import ParamGather
from pipeline.zero import ZeroAdamW


class OptimizerParts:
    """Made by :meth:`ParallelRuntime.optimizer_parts`; see the module docstring. `runtime` is the
    ParallelRuntime whose model (already prepared) the optimizer will update."""

    def __init__(self, runtime):
        self.runtime = runtime
        layout = runtime.layout
        self.sharded = runtime.zero_stage >= 1 and layout.dp > 1
        self.shard_group = layout.dp_group if self.sharded else None
        self.bf16_updates = self.sharded and runtime.grad_reduce_dtype == "bf16"
        self.buffer: GradBuffer | None = None
        self.gather: ParamGather | None = None
        self.counted: list[torch.Tensor] = []
        self._old: list[torch.Tensor] | None = None

    def build(self, muon_named, adamw_named, muon_hyper: dict, adamw_hyper: dict):
        """(muon, adamw) for the two groups of (name, parameter) (None for an empty group); lays out the buffer."""
        rt, layout = self.runtime, self.runtime.layout
        muon = None
        if muon_named:
            if rt.muon_functions is None:
                raise ValueError("distributed Muon needs the per-matrix functions (muon_functions)")
            muon = DistributedMuon(list(muon_named), layout, rt.tp_info.shards, rt.muon_functions,
                                   dp_sharded=self.sharded, **muon_hyper)
        owners = {n: muon.dp_owner(i) for i, n in enumerate(muon.names)} if muon is not None and self.sharded else {}
        dp, rank = (layout.dp, layout.dp_rank) if self.sharded else (1, 0)
        named, late = rt.gradient_order(list(muon_named) + list(adamw_named))
        self.buffer = GradBuffer(named, dp, rank, owners, late, rt.grad_buckets)
        rt.use_buffer(self.buffer)
        if self.sharded:
            reducer = rt.reducer
            self.gather = ParamGather(self.buffer, self.shard_group, reducer.bucket_width, reducer.max_in_flight)
            if rt.overlap_param_gather:
                self.gather.attach(rt.model)
        self.counted = counted_grad_views(self.buffer, rt.tp_info.shards, layout.tp, layout.tp_rank,
                                          exclude=rt.uncounted_names())
        adamw = None
        if adamw_named:
            adamw = ZeroAdamW(list(adamw_named), self.buffer, self.shard_group, fused=_fusable(adamw_named),
                              **adamw_hyper)
        return muon, adamw

    def grads_to_clip(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(gradients whose squares make this rank's share of the norm, gradients the clip scales)."""
        return self.counted, self.buffer.owned_grad_chunks()

    def norm_sq_reduce(self, local: torch.Tensor) -> torch.Tensor:
        """The global squared norm from this rank's share: summed over dp (sharded), tp and pp."""
        return reduce_norm_sq(local, self.runtime.layout, self.shard_group)

    @torch.no_grad()
    def begin_update(self) -> None:
        self.finish_update()  # the previous step's gather (its parameters are read and written now)
        if self.bf16_updates:
            self._old = [g.chunk(g.param_flat, self.buffer.rank).clone() for g in self.buffer.groups]

    @torch.no_grad()
    def end_update(self) -> None:
        """The all-gather of the updated chunks (nothing without sharding), in the reducer's column ranges: only
        launched with overlap_param_gather (see the module docstring), else finished before returning."""
        if not self.sharded:
            return
        if self.runtime.overlap_param_gather:
            self.gather.start(self._old)
        else:
            self.gather.run(self._old)
        self._old = None

    def finish_update(self) -> None:
        """Wait for the parameter all-gather still in flight, if any: every parameter holds its new value after."""
        if self.gather is not None:
            self.gather.finish()

    def zero_grad(self) -> None:
        self.buffer.zero_grad()


def _fusable(named) -> bool | None:
    """Fused AdamW when every parameter is a floating tensor on CPU or CUDA (else torch's default)."""
    return True if all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for _, p in named) else None
