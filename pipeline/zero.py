"""ZeRO-1 for the AdamW parameters: optimizer state for this rank's chunk of a :class:`GradBuffer` only.

The AdamW parameters are elements of the buffer's flat parameter vectors (one per dtype), and their gradients the
same elements of the flat gradient vectors. Data-parallel rank r updates only the AdamW elements of its chunk r:
the contiguous runs of them there (at most a few per dtype: the chunk also holds whole Muon matrices) become torch
AdamW "parameters" that are VIEWS of the flat vectors, so the step reads the reduced gradient and writes the new
values in place, with nothing flattened or copied per step. The updated chunks reach the other ranks through the
runtime's one all-gather of the buffer. exp_avg and exp_avg_sq therefore take about 1/dp of the bytes on each rank.
With one chunk (ZeRO stage 0, or dp 1) this is AdamW over every AdamW element.

Difference from torch's AdamW over the parameter list: a parameter without a gradient in a step is stepped with a
zero gradient (its moments still decay) instead of being skipped; every parameter of the looped LM gets a gradient
every step.

Checkpoints see layout-free state (:meth:`ZeroAdamW.sharded_state`): per parameter, exp_avg and exp_avg_sq of the
parameter's shape (this rank's tensor-parallel shard of it). Sharded over dp, each rank hands out only blocks of rows
it updates and reads back only the rows of its runs (:mod:`pipeline.zero_state`: no all-gather at save, 1/dp of the
moments read at load), so a checkpoint saved at one dp size loads at any other.
"""
from __future__ import annotations

import torch

from pipeline.collectives import all_gather_along
from pipeline.grad_buffer import FlatGroup, GradBuffer


def _runs(group: FlatGroup, rank: int, members: set[int]) -> list[tuple[int, int]]:
    """Maximal [start, end) ranges of chunk `rank` covered by adjacent pieces of the `members` parameters."""
    runs: list[list[int]] = []
    for index, a, b in group.segments(rank):
        if index not in members:
            continue
        if runs and runs[-1][1] == a:
            runs[-1][1] = b
        else:
            runs.append([a, b])
    return [(a, b) for a, b in runs]


class ZeroAdamW(torch.optim.Optimizer):
    """AdamW over the named parameters' elements in this rank's chunk of `buffer` (which must hold them);
    `dp_group` is the group the chunks are spread over (None: one chunk). param_groups[0] carries lr, betas, eps,
    weight_decay like torch's AdamW, so a scheduler that rewrites group["lr"] drives it unchanged."""

    def __init__(self, named_params, buffer: GradBuffer, dp_group, lr: float = 1e-3, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, fused: bool | None = None):
        named = [(n, p) for n, p in named_params if p.requires_grad]
        super().__init__([p for _, p in named], dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.buffer, self.dp_group = buffer, dp_group
        self.names = {id(p): n for n, p in named}
        self.masters: list[tuple[FlatGroup, int, int, torch.nn.Parameter]] = []
        for group in buffer.groups:
            members = {i for i, p in enumerate(group.params) if id(p) in self.names}
            for a, b in _runs(group, buffer.rank, members):
                master = torch.nn.Parameter(group.param_flat[a:b])  # shares the flat vector's storage
                master.grad = group.grad_flat[a:b]
                self.masters.append((group, a, b, master))
        self.steps_taken = 0.0  # the same on every rank (steps are taken or skipped together)
        kwargs = {"fused": fused} if fused is not None else {}
        self.inner = torch.optim.AdamW([m for *_, m in self.masters] or [torch.nn.Parameter(torch.zeros(1))],
                                       lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, **kwargs)

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
        if self.masters:
            self.inner.step()
        self.steps_taken += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The gradients are views of the buffer: the runtime zeroes the buffer in place."""

    def _flat_groups(self):
        """(group, AdamW parameters of it with their offsets) for each dtype group holding AdamW parameters."""
        for group in self.buffer.groups:
            mine = [(i, p) for i, p in enumerate(group.params) if id(p) in self.names]
            if mine:
                yield group, mine

    # ---- layout-free state for checkpoints ------------------------------------------------------------------
    MOMENTS = ("exp_avg", "exp_avg_sq")

    def adamw_params(self):
        """(flat group, [(index in the group, parameter)]) of every dtype group holding AdamW parameters."""
        return list(self._flat_groups())

    def run_state(self, group, start: int, stop: int, moment: str) -> torch.Tensor:
        """The view of `moment` over flat elements [start, stop) of `group`, which must lie in one of this rank's
        runs."""
        for g, a, b, master in self.masters:
            if g is group and a <= start and stop <= b:
                return self.inner.state[master][moment][start - a:stop - a]
        raise ValueError(f"flat elements [{start}, {stop}) are not updated by data-parallel rank {self.buffer.rank}")

    @torch.no_grad()
    def sharded_state(self, prefix: str, spec_of=None) -> tuple[list[tuple], dict[str, float]]:
        """(entries, steps): the step count of every parameter once a step was taken, and entries
        (f"{prefix}/{moment}/{name}", name, tensor, kind). Sharded over dp: blocks of rows this rank writes (kind a
        RowBlock; collective over dp, see :mod:`pipeline.zero_state`; spec_of(name) gives a parameter's ShardSpec);
        else the whole moment shaped like the parameter (kind True)."""
        entries: list[tuple] = []
        if not self.steps_taken:
            return entries, {}
        if self.dp_group is not None and self.buffer.dp > 1:
            from pipeline.zero_state import owner_blocks

            return owner_blocks(self, prefix, spec_of), {name: self.steps_taken for name in self.names.values()}
        for group, mine in self._flat_groups():
            for moment in self.MOMENTS:
                chunk = torch.zeros_like(group.chunk(group.param_flat, self.buffer.rank))
                base = self.buffer.rank * group.chunk_len
                for g, a, b, master in self.masters:
                    if g is group:
                        chunk[a - base:b - base] = self.inner.state[master][moment]
                full = all_gather_along(chunk, 0, self.dp_group)
                for i, p in mine:
                    off = group.offsets[i]
                    name = self.names[id(p)]
                    entries.append((f"{prefix}/{moment}/{name}", name, full[off:off + p.numel()].view(p.shape), True))
        return entries, {name: self.steps_taken for name in self.names.values()}

    @torch.no_grad()
    def load_sharded_state(self, read, prefix: str, steps: dict[str, float]) -> None:
        """Take this rank's runs of every moment from per-parameter arrays: read(array, name, sharded=True)
        returns the tensor shaped like this rank's parameter, or None when the checkpoint has no such state."""
        if not all(name in steps for name in self.names.values()):
            return
        step = next(iter(steps[n] for n in self.names.values()))
        if self.dp_group is not None and self.buffer.dp > 1 and hasattr(read, "rows"):
            from pipeline.zero_state import load_owned

            runs = load_owned(self, read.rows, prefix)  # only the rows of this rank's runs are read
        else:
            runs = self._load_whole(read, prefix)
        inner_state = {index: {"step": torch.tensor(step, dtype=torch.float32), **run}
                       for index, run in enumerate(runs)}
        saved = self.inner.state_dict()
        saved["state"] = inner_state
        self.inner.load_state_dict(saved)
        self.steps_taken = step

    def _load_whole(self, read, prefix: str) -> list[dict]:
        """{moment: tensor} of every run, cut from whole per-parameter arrays (read(array, name, True))."""
        full = {}
        for group, mine in self._flat_groups():
            for moment in self.MOMENTS:
                flat = torch.zeros_like(group.param_flat)
                for i, p in mine:
                    value = read(f"{prefix}/{moment}/{self.names[id(p)]}", self.names[id(p)], True)
                    flat[group.offsets[i]:group.offsets[i] + p.numel()] = value.reshape(-1).to(flat.dtype)
                full[id(group), moment] = flat
        return [{m: full[id(g), m][a:b].clone() for m in self.MOMENTS} for g, a, b, _ in self.masters]
