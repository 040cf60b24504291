"""ZeRO-1 for the AdamW parameters: optimizer state sharded by elements over the data-parallel group.

The AdamW parameters of this rank (tensor-parallel shards included) are laid end to end in one flat vector per dtype,
padded to a multiple of dp; data-parallel rank r owns elements [r L, (r+1) L) with L = padded / dp. Per step each
rank takes its slice of the (already dp-summed) flat gradient, runs torch's AdamW on its slice only (AdamW is
elementwise, so a slice may cut through parameters), and the updated slices are all-gathered back into the
parameters. exp_avg and exp_avg_sq therefore take 1/dp of the bytes on each rank.

Difference from torch's AdamW over the whole list: a parameter without a gradient is stepped with a zero gradient
(its moments still decay) instead of being skipped; every parameter of the looped LM gets a gradient every step.

Checkpoints see layout-free state (:meth:`ZeroAdamW.sharded_state`): per parameter, exp_avg and exp_avg_sq shaped like
the parameter (this rank's tensor-parallel shard of it), assembled by one all-gather of the flat moments over dp, so
a checkpoint saved at one dp size loads at any other (:meth:`ZeroAdamW.load_sharded_state` takes its slice back).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeline.collectives import all_gather_along, group_size


@dataclass
class _FlatShard:
    params: list[torch.Tensor]
    names: list[str]
    numel: int
    shard_len: int
    start: int
    master: torch.nn.Parameter  # this rank's slice of the flat parameters


class ZeroAdamW(torch.optim.Optimizer):
    """AdamW whose state is sharded over `dp_group`. param_groups[0] carries lr, betas, eps, weight_decay like
    torch's AdamW, so a scheduler that rewrites group["lr"] drives it unchanged."""

    def __init__(self, params, dp_group, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, fused: bool | None = None, names: list[str] | None = None):
        params = list(params)
        names = list(names) if names is not None else [f"param{i}" for i in range(len(params))]
        named = [(n, p) for n, p in zip(names, params, strict=True) if p.requires_grad]
        super().__init__([p for _, p in named], dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.dp_group = dp_group
        self.dp = group_size(dp_group)
        self.dp_rank = 0 if dp_group is None else dist.get_rank(dp_group)
        self.shards = [self._make_shard([(n, p) for n, p in named if p.dtype == dtype])
                       for dtype in dict.fromkeys(p.dtype for _, p in named)]
        kwargs = {"fused": fused} if fused is not None else {}
        self.inner = torch.optim.AdamW([s.master for s in self.shards], lr=lr, betas=tuple(betas), eps=eps,
                                       weight_decay=weight_decay, **kwargs)

    def _make_shard(self, named: list[tuple[str, torch.Tensor]]) -> _FlatShard:
        params = [p for _, p in named]
        numel = sum(p.numel() for p in params)
        shard_len = -(-numel // self.dp)
        start = self.dp_rank * shard_len
        flat = self._flatten([p.detach() for p in params], shard_len * self.dp)
        master = torch.nn.Parameter(flat[start:start + shard_len].clone())
        return _FlatShard(params, [n for n, _ in named], numel, shard_len, start, master)

    @staticmethod
    def _flatten(tensors: list[torch.Tensor], padded: int) -> torch.Tensor:
        flat = torch.cat([t.reshape(-1) for t in tensors])
        return torch.nn.functional.pad(flat, (0, padded - flat.numel()))

    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank (moments and step counters)."""
        return sum(t.numel() * t.element_size() for st in self.inner.state.values() for t in st.values()
                   if torch.is_tensor(t))

    @torch.no_grad()
    def step(self, closure=None):
        group = self.param_groups[0]
        for inner_group in self.inner.param_groups:
            for key in ("lr", "betas", "eps", "weight_decay"):
                inner_group[key] = group[key]
        for shard in self.shards:
            params = self._flatten([p.detach() for p in shard.params], shard.shard_len * self.dp)
            shard.master.copy_(params[shard.start:shard.start + shard.shard_len])  # the parameters may have been loaded
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in shard.params]
            flat_grad = self._flatten(grads, shard.shard_len * self.dp)
            shard.master.grad = flat_grad[shard.start:shard.start + shard.shard_len].clone()
        self.inner.step()
        for shard in self.shards:
            shard.master.grad = None
            full = all_gather_along(shard.master.detach(), 0, self.dp_group)
            offset = 0
            for p in shard.params:
                p.copy_(full[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    # ---- layout-free state for checkpoints ------------------------------------------------------------------
    MOMENTS = ("exp_avg", "exp_avg_sq")

    @torch.no_grad()
    def sharded_state(self, prefix: str) -> tuple[list[tuple], dict[str, float]]:
        """(entries, steps): entries (f"{prefix}/{moment}/{name}", name, tensor shaped like the parameter, True)
        from one all-gather of each flat moment over dp (collective: every dp rank calls it), and the step count of
        every parameter that has state."""
        entries, steps = [], {}
        for shard in self.shards:
            state = self.inner.state.get(shard.master)
            if not state:
                continue
            for moment in self.MOMENTS:
                full = all_gather_along(state[moment].detach(), 0, self.dp_group)
                offset = 0
                for name, p in zip(shard.names, shard.params):
                    entries.append((f"{prefix}/{moment}/{name}", name, full[offset:offset + p.numel()].view(p.shape),
                                    True))
                    offset += p.numel()
            steps.update({name: float(state["step"]) for name in shard.names})
        return entries, steps

    @torch.no_grad()
    def load_sharded_state(self, read, prefix: str, steps: dict[str, float]) -> None:
        """Take this rank's slice of every flat moment from per-parameter arrays: read(array, name, sharded=True)
        returns the tensor shaped like this rank's parameter, or None when the checkpoint has no such state."""
        inner_state = {}
        for index, shard in enumerate(self.shards):
            if not all(name in steps for name in shard.names):
                continue
            moments = {}
            for moment in self.MOMENTS:
                tensors = [read(f"{prefix}/{moment}/{name}", name, True) for name in shard.names]
                flat = self._flatten([t.to(shard.master.dtype) for t in tensors], shard.shard_len * self.dp)
                moments[moment] = flat[shard.start:shard.start + shard.shard_len].clone()
            inner_state[index] = {"step": torch.tensor(steps[shard.names[0]], dtype=torch.float32), **moments}
        saved = self.inner.state_dict()
        saved["state"] = inner_state
        self.inner.load_state_dict(saved)
