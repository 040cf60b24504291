"""Distributed Muon: every matrix is orthogonalised by one owner rank, which writes the new matrix in place.

Muon's step on a matrix needs the whole matrix (Polar Express, NorMuon's row/column statistics, the shape factor of
the learning rate), so its state cannot be split by elements. Instead each matrix is owned by one rank of the
(dp x tp) grid, matrices balanced by size (largest first, each to the least-loaded owner; the same on every rank).
With `dp_sharded` false (ZeRO stage 0) the owners are spread over tp only and every data-parallel slice computes
every matrix. For a matrix with owner (dp_o, tp_o), per step (each phase issued for all matrices before the next):

  1. the tp ranks of data-parallel slice dp_o gather the full gradient on tp_o (split matrices; a replicated one is
     already whole there);
  2. tp_o advances the matrix's momentum and second moment and computes the update (`update_fn`, megaloop's
     per-matrix muon_update, passed in as a callable: pipeline never imports megaloop);
  3. tp_o scatters the update's shards (or broadcasts a replicated update) to the tp ranks of slice dp_o;
  4. those ranks apply their shard in place (`apply_fn`: cautious weight decay + learning rate times the shape
     factor of the FULL matrix).

Ranks of other data-parallel slices leave the matrix alone: the runtime's gradient buffer puts it in chunk dp_o
(:meth:`DistributedMuon.dp_owner`), whose gradient slice dp_o alone has summed (reduce-scatter) and whose updated
values reach every rank in the buffer's one all-gather. Optimizer state lives only on owners, so per rank it is the
total over (dp x tp) to within one matrix. The gradients must already be summed over dp for the owned matrices (and
over tp for sequence-parallel partial sums).

Checkpoints: the owner of a matrix holds its whole state, so :meth:`DistributedMuon.sharded_state` hands out the
full arrays keyed by parameter name, and :meth:`DistributedMuon.load_sharded_state` reads the matrices this rank
owns under the current layout, whatever layout saved them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from pipeline.collectives import group_size
from pipeline.tensor_parallel import ShardSpec, shard_tensor, unshard_tensor


@dataclass(frozen=True)
class MuonFunctions:
    """The per-matrix Muon math, given by the caller: init_state(full_param) -> state dict; hparams(**group) ->
    hyperparameter object; update(full_grad, state, hparams) -> update; apply(param_shard, update_shard, lr, wd);
    lr_scale(full_shape) -> float."""

    init_state: Callable
    hparams: Callable
    update: Callable
    apply: Callable
    lr_scale: Callable


def full_shape(local: torch.Tensor, spec: ShardSpec | None) -> tuple[int, ...]:
    shape = list(local.shape)
    if spec is not None:
        shape[spec.dim] *= spec.tp
    return tuple(shape)


def assign_owners(sizes: list[int], n_owners: int) -> list[int]:
    """Owner slot of every matrix: largest first, each to the least-loaded slot (ties: lowest slot, then the
    matrix's index), so the load of any slot is at most the average plus one matrix."""
    load = [0] * n_owners
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        slot = min(range(n_owners), key=lambda s: (load[s], s))
        owners[index] = slot
        load[slot] += sizes[index]
    return owners


class DistributedMuon(torch.optim.Optimizer):
    """Muon over (possibly tensor-parallel split) matrices with state owned per matrix; see the module docstring.

    param_groups carry lr, momentum, weight_decay, beta2, nesterov, ns_steps like megaloop's Muon, so a scheduler
    that rewrites them (the combined optimizer) drives this one unchanged. Parameters are given with their names so
    the tp split (`shards`: name -> ShardSpec) is known."""

    def __init__(self, named_params: list[tuple[str, torch.Tensor]], layout, shards: dict[str, ShardSpec],
                 fns: MuonFunctions, orth_dtype: torch.dtype = torch.bfloat16, dp_sharded: bool = True,
                 **defaults):
        super().__init__([p for _, p in named_params], defaults)
        self.names = [n for n, _ in named_params]
        self.layout = layout
        self.fns = fns
        self.orth_dtype = orth_dtype
        self.specs = [shards.get(n) if layout.tp > 1 else None for n in self.names]
        self.full_shapes = [full_shape(p, s) for (_, p), s in zip(named_params, self.specs)]
        sizes = [int(torch.Size(s).numel()) for s in self.full_shapes]
        self.dp_sharded = dp_sharded
        self.owners = assign_owners(sizes, (layout.dp if dp_sharded else 1) * layout.tp)
        self.owned_state: dict[int, dict] = {}

    def _owner(self, index: int) -> tuple[int, int]:
        """(dp_rank, tp_rank) of the owner of matrix `index`."""
        slot = self.owners[index]
        if not self.dp_sharded:
            return self.layout.dp_rank, slot
        return slot // self.layout.tp, slot % self.layout.tp

    def dp_owner(self, index: int) -> int:
        """The data-parallel rank whose slice updates matrix `index`."""
        return self._owner(index)[0]

    def owned(self) -> list[int]:
        me = (self.layout.dp_rank, self.layout.tp_rank)
        return [i for i in range(len(self.names)) if self._owner(i) == me]

    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank."""
        return sum(t.numel() * t.element_size() for st in self.owned_state.values() for t in st.values())

    @torch.no_grad()
    def step(self, closure=None):
        """Three phases, so the owners of a tp group orthogonalise their matrices at the same time: every gather
        of this slice's matrices is issued, then each owner computes its updates, then every scatter/broadcast is
        issued (a per-matrix gather-compute-scatter would make the tp ranks take turns)."""
        group = self.param_groups[0]
        if len(self.param_groups) != 1:
            raise ValueError("DistributedMuon takes one parameter group")
        hp = self.fns.hparams(momentum=group["momentum"], nesterov=group["nesterov"], beta2=group["beta2"],
                              ns_steps=group["ns_steps"], orth_dtype=self.orth_dtype)
        params = group["params"]
        mine = [i for i in range(len(params)) if self._owner(i)[0] == self.layout.dp_rank]
        full_grads = self._gather_grads(mine, params)
        updates = {i: self._owner_update(i, full_grads.pop(i), hp) for i in list(full_grads)}
        for index, update in self._share_updates(mine, params, updates):
            lr = group["lr"] * self.fns.lr_scale(self.full_shapes[index])
            self.fns.apply(params[index], update, lr, group["weight_decay"])

    def _grad(self, param: torch.Tensor) -> torch.Tensor:
        return param.grad if param.grad is not None else torch.zeros_like(param)

    def _gather_grads(self, indices: list[int], params) -> dict[int, torch.Tensor]:
        """Phase 1: the full gradient of every matrix in `indices` that this rank owns (split matrices gathered
        from the tp ranks, all gathers in flight at once)."""
        tp_group, tp_rank = self.layout.tp_group, self.layout.tp_rank
        full, pending = {}, []
        for index in indices:
            spec, tp_o, grad = self.specs[index], self._owner(index)[1], self._grad(params[index])
            if self.layout.tp > 1 and spec is not None:
                shards = [torch.empty_like(grad) for _ in range(self.layout.tp)] if tp_rank == tp_o else None
                dst = dist.get_global_rank(tp_group, tp_o)
                work = dist.gather(grad.contiguous(), shards, dst=dst, group=tp_group, async_op=True)
                pending.append((work, index, shards, spec))
            elif tp_rank == tp_o:
                full[index] = grad
        for work, index, shards, spec in pending:
            work.wait()
            if shards is not None:
                full[index] = unshard_tensor(shards, spec)
        return full

    def _owner_update(self, index: int, full_grad: torch.Tensor, hp) -> torch.Tensor:
        """Phase 2 on the owner: create the full-matrix state on first use, advance it, return the update."""
        if index not in self.owned_state:
            like = torch.empty(self.full_shapes[index], dtype=full_grad.dtype, device=full_grad.device)
            self.owned_state[index] = self.fns.init_state(like)
        return self.fns.update(full_grad, self.owned_state[index], hp)

    @staticmethod
    def _state_dtype(param: torch.Tensor) -> torch.dtype:
        return torch.promote_types(param.dtype, torch.float32)

    def _share_updates(self, indices: list[int], params, updates: dict[int, torch.Tensor]):
        """Phase 3: (index, this rank's shard of the update) for every matrix in `indices`: the owner's update
        scattered (split matrix) or broadcast (replicated) within the tp group, all in flight at once."""
        tp_group = self.layout.tp_group
        if group_size(tp_group) == 1:
            return [(i, updates[i]) for i in indices]
        tp_rank, pending = self.layout.tp_rank, []
        for index in indices:
            spec, tp_o, param = self.specs[index], self._owner(index)[1], params[index]
            src, update = dist.get_global_rank(tp_group, tp_o), updates.get(index)
            dtype = self._state_dtype(param)
            if spec is not None:
                out = torch.empty(param.shape, dtype=dtype, device=param.device)
                pieces = [shard_tensor(update, spec, r) for r in range(spec.tp)] if tp_rank == tp_o else None
                work = dist.scatter(out, pieces, src=src, group=tp_group, async_op=True)
            else:
                out = update if tp_rank == tp_o else torch.empty(param.shape, dtype=dtype, device=param.device)
                work = dist.broadcast(out, src=src, group=tp_group, async_op=True)
            pending.append((work, index, out, pieces if spec is not None else None))
        shares = []
        for work, index, out, _pieces in pending:  # the pieces stay referenced until their scatter is done
            work.wait()
            shares.append((index, out))
        return shares

    # ---- layout-free state for checkpoints ------------------------------------------------------------------
    def sharded_state(self, prefix: str) -> list[tuple]:
        """Entries (f"{prefix}/{key}/{name}", name, full-matrix state tensor, False) of the matrices this rank owns."""
        return [(f"{prefix}/{key}/{self.names[index]}", self.names[index], tensor, False)
                for index, state in sorted(self.owned_state.items()) for key, tensor in state.items()]

    @torch.no_grad()
    def load_sharded_state(self, read, prefix: str) -> None:
        """Load the state of every matrix this rank owns: read(array, name, sharded=False) returns the whole array,
        or None when the checkpoint holds no state for it (the matrix then starts fresh, as it would have)."""
        self.owned_state = {}
        for index in self.owned():
            name = self.names[index]
            like = torch.empty(self.full_shapes[index], dtype=self.param_groups[0]["params"][index].dtype,
                               device=self.param_groups[0]["params"][index].device)
            fresh = self.fns.init_state(like)
            loaded = {key: read(f"{prefix}/{key}/{name}", name, False) for key in fresh}
            if any(t is None for t in loaded.values()):
                continue
            self.owned_state[index] = {key: loaded[key].to(dtype=t.dtype, device=t.device).reshape(t.shape)
                                       for key, t in fresh.items()}
