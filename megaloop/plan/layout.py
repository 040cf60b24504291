"""The per-rank view the planner works on: the parallel layout and every parameter's local (tensor-parallel) shape.

Shapes come from the model built on the meta device and from megaloop's tensor-parallel plan (the same data the
trainer hands to `pipeline.tensor_parallel`), so the planner never re-derives parameter counts by hand.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from megaloop.config import Config, ConfigError
from megaloop.model import build_model
from megaloop.model.tp_plan import tensor_parallel_plan
from megaloop.optim.grouping import split_param_groups
from pipeline.grad_buffer import lookup_parameters

# style -> which dimension of the weight is split (nn.Linear / nn.Embedding); see megaloop/model/tp_plan.py
_SPLIT_DIM = {"vocab": {"Embedding": 0}, "column": {"Linear": 0, "Embedding": 1},
              "column-paired": {"Linear": 0}, "row": {"Linear": 1}}


@dataclass(frozen=True)
class Layout:
    """world = tp x pp x dp processes; `engine` and `zero_stage` as in parallel.*; sp: sequence parallelism."""

    tp: int
    pp: int
    dp: int
    sp: bool
    engine: str
    zero_stage: int

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(frozen=True)
class LocalParam:
    """One parameter on one rank: its name, full shape, the shape this rank holds, its optimizer, and whether it is
    an embedding lookup's (its gradient is final only at the end of backward: pipeline.grad_buffer.gradient_order)."""

    name: str
    full_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    optimizer: str  # "muon" | "adamw"
    lookup: bool = False

    @property
    def full_numel(self) -> int:
        return _numel(self.full_shape)

    @property
    def local_numel(self) -> int:
        return _numel(self.local_shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def resolve_layout(cfg: Config, world: int) -> Layout:
    """The layout of a job of `world` processes (dp derived when parallel.dp is null), or a ConfigError."""
    p = cfg.parallel
    if world < 1:
        raise ConfigError("--nodes x --gpus-per-node", world, "must be >= 1 GPU")
    if world % (p.tp * p.pp):
        fits = [t for t in range(1, world + 1) if world % t == 0 and cfg.model.n_heads % t == 0]
        raise ConfigError("parallel.tp", p.tp, f"the job's {world} GPUs are not a multiple of tp x pp = {p.tp} x "
                          f"{p.pp}; tp values that fit: {fits}")
    dp = world // (p.tp * p.pp)
    if p.dp is not None and p.dp != dp:
        raise ConfigError("parallel.dp", p.dp, f"tp x pp x dp must equal the job's {world} GPUs: use "
                          f"parallel.dp={dp} or leave it null")
    sp = (p.tp > 1) if p.sequence_parallel is None else bool(p.sequence_parallel and p.tp > 1)
    m = cfg.model
    for name, size in (("model.n_heads", m.n_heads), ("model.n_kv_heads", m.kv_heads),
                       ("model.vocab_size", m.vocab_size)) + ((("model.seq_len", m.seq_len),) if sp else ()):
        if size % p.tp:
            raise ConfigError("parallel.tp", p.tp, f"must divide {name}={size}")
    return Layout(tp=p.tp, pp=p.pp, dp=dp, sp=sp, engine=p.engine, zero_stage=p.zero_stage)


def local_params(cfg: Config, tp: int) -> list[LocalParam]:
    """Every parameter (the tied head once) with the shape one tensor-parallel rank holds, in model order."""
    model = build_model(cfg.model, device="meta")
    plan = tensor_parallel_plan(cfg.model.mlp)
    split: dict[str, tuple[int, int]] = {}  # parameter name -> (dim, parts)
    for mname, module in model.named_modules():
        for pattern, style in plan:
            dims = _SPLIT_DIM.get(style, {})
            kind = type(module).__name__
            if tp > 1 and kind in dims and fnmatch.fnmatchcase(mname, pattern):
                split[f"{mname}.weight"] = (dims[kind], 2 if style == "column-paired" else 1)
    groups = split_param_groups(model.named_parameters(), optimizer=cfg.optim.name)
    which = {name: "muon" for name, _ in groups.muon} | {name: "adamw" for name, _ in groups.adamw}
    lookups = lookup_parameters(model)
    out = []
    for name, param in model.named_parameters():
        full = tuple(param.shape)
        local = list(full)
        if name in split:
            dim, parts = split[name]
            if full[dim] % (parts * tp):
                raise ConfigError("parallel.tp", tp, f"{name} has {full[dim]} rows/columns along its split "
                                  f"dimension, which {parts} part(s) x tp do not divide")
            local[dim] //= tp
        out.append(LocalParam(name, full, tuple(local), which.get(name, "adamw"), id(param) in lookups))
    return out
