"""The distributed parts that megaloop's combined optimizer is built with under the native engine.

The combined optimizer (megaloop) keeps the schedules, clipping, skipping and step records; these parts supply
what depends on the layout:

- :meth:`OptimizerParts.build` makes the distributed Muon and the ZeRO AdamW for the two parameter groups, lays out
  the :class:`GradBuffer` (each Muon matrix in its owner's chunk, AdamW elements filling the chunks evenly) and hands
  it to the runtime's reducer (reduce-scatter under ZeRO-1 with dp > 1, all-reduce under stage 0);
- :meth:`grads_to_clip` gives the gradient pieces this rank holds summed (its chunk) and :meth:`norm_sq_reduce`
  turns their sum of squares into the global one: one scalar all-reduce over dp, then tp and pp, with parameters
  replicated over tp counted on tp rank 0 only;
- :meth:`begin_update` / :meth:`end_update` bracket the inner steps: end_update runs the all-gather per dtype of
  the updated chunks (one call while a gradient bucket holds a whole chunk, else one per bucket-sized column range).
  With gradient reduction in fp32 it carries the new parameters (exact); in bf16 it carries the updates
  (new - old) in bf16, which every rank, the owner included, adds to its old values, so replicas stay bit-identical
  while the all-gather moves half the bytes;
- :meth:`zero_grad` zeroes the buffer in place (the .grad views stay attached).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from pipeline.dist_muon import DistributedMuon
from pipeline.grad_buffer import GradBuffer
from pipeline.grad_norm import counted_grad_views, reduce_norm_sq
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
        self.counted: list[torch.Tensor] = []
        self._old: list[torch.Tensor] = []

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
        self.buffer = GradBuffer(list(muon_named) + list(adamw_named), dp, rank, owners)
        rt.use_buffer(self.buffer)
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
        if self.bf16_updates:
            self._old = [g.chunk(g.param_flat, self.buffer.rank).clone() for g in self.buffer.groups]

    @torch.no_grad()
    def end_update(self) -> None:
        """The all-gather per dtype of the updated chunks (nothing without sharding), in column ranges of at most
        the reducer's bucket size: one call when a bucket holds the whole chunk (then in place), else one per range
        through a range-sized buffer, so no step holds a full-size copy on any backend."""
        if not self.sharded:
            return
        width = self.runtime.reducer.bucket_width
        for index, g in enumerate(self.buffer.groups):
            for lo in range(0, g.chunk_len, width(g)):
                self._gather_columns(g, index, lo, min(lo + width(g), g.chunk_len))
        self._old = []

    def _gather_columns(self, g, index: int, lo: int, hi: int) -> None:
        rank, group = self.buffer.rank, self.shard_group
        params = g.param_flat.view(g.dp, g.chunk_len)
        mine = params[rank, lo:hi]
        if not self.bf16_updates:
            if hi - lo == g.chunk_len:
                dist.all_gather_single(g.param_flat, mine, group=group)
                return
            gathered = torch.empty((g.dp, hi - lo), dtype=mine.dtype, device=mine.device)
            dist.all_gather_single(gathered.view(-1), mine, group=group)
            params[:, lo:hi].copy_(gathered)
            return
        old = self._old[index][lo:hi]
        delta = (mine - old).to(torch.bfloat16)
        mine.copy_(old)  # every rank, the owner too, adds the same bf16 delta to the same old values
        deltas = torch.empty((g.dp, hi - lo), dtype=torch.bfloat16, device=mine.device)
        dist.all_gather_single(deltas.view(-1), delta, group=group)
        params[:, lo:hi].add_(deltas)

    def zero_grad(self) -> None:
        self.buffer.zero_grad()


def _fusable(named) -> bool | None:
    """Fused AdamW when every parameter is a floating tensor on CPU or CUDA (else torch's default)."""
    return True if all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for _, p in named) else None
