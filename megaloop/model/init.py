"""The reference's "scaled-zero" orthogonal initialisation (PARCAE_REFERENCE.md section 4), one parameter at a time.

wte, q, k, v, C, mlp.fc: truncated orthogonal with entry std ~ sigma = sqrt(2/(5d)); attn.proj and mlp.proj: zero;
norms: 1; A_log = 0, dt_bias = softplus^-1(0.5 ln 5), B = I; concat W: truncated normal (sigma, +-3 sigma);
value embeddings N(0, 1) and ve_gate torch's default kaiming-uniform, as in the reference.

Keying. Parameter `name` (its qualified name in the model, e.g. "core.3.attn.q.weight") draws from its own
torch.Generator seeded by megaloop.rng.name_seed(seed, name). Its values therefore do not depend on which other
parameters are initialised, in which order, or by which process: a pipeline stage or a tensor-parallel rank can build
the model on the meta device (build_model(cfg, "meta")) and `materialize` only the names it holds.

Numerics. Every value is computed on the CPU in float64 on a single thread (the Householder QR of the orthogonal
init is blocked LAPACK, whose rounding changes with the thread count), then rounded to float32 (float64 targets keep
the float64 value), cast to the target dtype and moved to the target device. So a parameter has the same bits
whatever the thread count, the device, the layout or the order; `build_model(...).to(bf16)` and a direct bf16
materialisation agree because both round through float32. The bits can differ between CPU kinds, since MKL picks
its kernels by instruction set (setting MKL_CBWR=COMPATIBLE pins them, at some speed); the ranks of one cluster
agree. Cost: the QRs dominate; benchmarks/init_cost.py prints them (a 2048 x 2048 matrix, parcae-1_3b's full init).

Tensor parallelism (not wired yet). Orthogonality is a property of the whole matrix, so a shard cannot be drawn on
its own: a rank that holds a shard computes the full parameter with `init_parameter` and slices its rows or columns
(transient memory: one full matrix in float64 on the CPU at a time), which gives it exactly the bits a single
process would hold there.
"""
from __future__ import annotations

import contextlib
import math
import re
from typing import Callable, Iterable

import torch
from torch import nn

from megaloop.model.injection import dt_bias_init
from megaloop.model.layers import rope_tables
from megaloop.rng import name_seed

_F64 = torch.float64


@contextlib.contextmanager
def single_thread():
    """Run torch's CPU kernels (MKL/LAPACK included) on one thread, restoring the previous thread count after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def scaled_orthogonal(shape: tuple[int, ...], std: float, g: torch.Generator) -> torch.Tensor:
    """Float64 truncated orthogonal (a +-2 truncated normal, QR, signs fixed by R's diagonal) with gain
    std * sqrt(max(rows, cols)), so that entries have std ~ `std`; rows (or columns, if fewer) are orthonormal
    times the gain."""
    rows, cols = shape[0], math.prod(shape) // shape[0]
    flat = torch.empty(max(rows, cols), min(rows, cols), dtype=_F64)
    nn.init.trunc_normal_(flat, mean=0.0, std=1.0, a=-2.0, b=2.0, generator=g)
    q, r = torch.linalg.qr(flat)
    q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
    if rows < cols:
        q = q.t()
    return q.reshape(shape).mul_(std * math.sqrt(max(rows, cols)))


def _normal(shape, std, g):
    return torch.empty(shape, dtype=_F64).normal_(0.0, 1.0, generator=g)


def _ve_gate(shape, std, g):
    bound = 1.0 / math.sqrt(shape[1])  # kaiming_uniform(a=sqrt 5) of nn.Linear == U(-1/sqrt(fan_in), +)
    return torch.empty(shape, dtype=_F64).uniform_(-bound, bound, generator=g)


def _trunc_normal(shape, std, g):
    return nn.init.trunc_normal_(torch.empty(shape, dtype=_F64), 0.0, std, -3 * std, 3 * std, generator=g)


def _eye(shape, std, g):
    if len(shape) != 2 or shape[0] != shape[1]:
        raise ValueError(f"injection.B must be square, got shape {tuple(shape)}")
    return torch.eye(shape[0], dtype=_F64)


# (pattern on the qualified name, init(shape, std, generator) -> float64 tensor); the first match wins.
_RULES: list[tuple[re.Pattern, Callable]] = [(re.compile(p), fn) for p, fn in [
    (r"(^|\.)(norm_\d+|prelude_norm|final_norm)\.weight$", lambda s, std, g: torch.ones(s, dtype=_F64)),
    (r"^embed\.weight$|^C\.weight$|\.attn\.[qkv]\.weight$|\.mlp\.fc\.weight$", scaled_orthogonal),
    (r"\.attn\.proj\.weight$|\.mlp\.proj\.weight$|^injection\.A_log$", lambda s, std, g: torch.zeros(s, dtype=_F64)),
    (r"^value_embeds\.\d+\.weight$", _normal),
    (r"\.attn\.ve_gate\.weight$", _ve_gate),
    (r"^injection\.dt_bias$", lambda s, std, g: torch.full(s, dt_bias_init(), dtype=_F64)),
    (r"^injection\.B$", _eye),
    (r"^injection\.W\.weight$", _trunc_normal),
]]


def _rule(name: str) -> Callable:
    for pattern, fn in _RULES:
        if pattern.search(name):
            return fn
    raise ValueError(f"no initialisation rule for parameter {name!r}: add one to megaloop/model/init.py _RULES "
                     "(a new parameter needs its reference initialisation stated)")


_DRAW_UNITS = 75  # one float64 random draw costs about 75 units of QR work (rows x cols x min(rows, cols)): measured
#                  with benchmarks/init_cost.py's shapes on one thread (normal draws ~2e-7 s each, QR ~2.7e-9 s/unit)
_RANDOM_RULES = (scaled_orthogonal, _normal, _ve_gate, _trunc_normal)


def init_parameter_cost(name: str, shape: Iterable[int]) -> int:
    """A relative cost of init_parameter(name, shape), to deal parameters over ranks: the QR of an orthogonal init
    (~ rows x cols x min(rows, cols)) plus its random draws (_DRAW_UNITS per element), or the draws alone, or the
    element count for a constant fill."""
    shape = [int(n) for n in shape]
    numel = math.prod(shape)
    rule = _rule(name)
    cost = numel * _DRAW_UNITS if rule in _RANDOM_RULES else numel
    if rule is scaled_orthogonal:
        rows, cols = shape[0], numel // max(shape[0], 1)
        cost += numel * min(rows, cols)
    return cost


def _round(value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 stays; anything else rounds through float32 (the same bits as an fp32 build cast afterwards)."""
    return value if dtype == _F64 else value.to(torch.float32).to(dtype)


@torch.no_grad()
def init_parameter(cfg, name: str, shape: Iterable[int], seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu") -> torch.Tensor:
    """The reference initial value of parameter `name` of a model built from `cfg` (a ModelConfig): a pure function
    of (cfg.std, name, shape, seed), whatever else is initialised and on how many threads."""
    shape = tuple(int(n) for n in shape)
    fn = _rule(name)
    g = torch.Generator().manual_seed(name_seed(seed, name))
    with single_thread():
        value = _round(fn(shape, cfg.std, g), dtype)
    return value.contiguous().to(device)  # LAPACK's Q is column-major: give the row-major layout of an eager build


def _select(model: nn.Module, names: Iterable[str] | None) -> list[tuple[str, nn.Parameter]]:
    params = dict(model.named_parameters())
    if names is None:
        return list(params.items())
    wanted = list(dict.fromkeys(names))
    unknown = [n for n in wanted if n not in params]
    if unknown:
        raise ValueError(f"not parameters of this model: {unknown[:5]}; names are as in model.named_parameters(), "
                         f"e.g. {list(params)[:3]}")
    return [(n, params[n]) for n in wanted]


def _materialize_buffers(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Meta buffers are functions of the config (the RoPE tables): recompute them as an eager build would have."""
    meta = [name for name, b in model.named_buffers() if b.is_meta]
    if not meta:
        return
    if sorted(meta) != ["rope_cos", "rope_sin"]:
        raise ValueError(f"cannot materialise meta buffers {meta}: only the RoPE tables are known here")
    cfg = model.cfg
    table_dtype = dtype if dtype in (torch.float32, _F64) else torch.float32
    cos, sin = rope_tables(cfg.head_dim, cfg.seq_len, cfg.rope_base, table_dtype)
    model.rope_cos, model.rope_sin = cos.to(device, dtype), sin.to(device, dtype)


@torch.no_grad()
def materialize(model: nn.Module, names: Iterable[str] | None = None, seed: int = 0,
                device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> nn.Module:
    """Replace the named parameters of `model` (all of them when names is None) by fresh, initialised ones on
    `device` (default: the parameter's device, the CPU for a meta one) in `dtype` (default: the parameter's dtype);
    parameters not named are left as they are (on the meta device: allocating nothing). Meta buffers (the RoPE
    tables, a few KiB) are materialised on `device` (default: the CPU) whatever the names. Returns the model."""
    cfg = model.cfg
    for name, p in _select(model, names):
        target = torch.device(device) if device is not None else (torch.device("cpu") if p.is_meta else p.device)
        value = init_parameter(cfg, name, p.shape, seed, dtype or p.dtype, target)
        module_name, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(module_name), leaf, nn.Parameter(value, requires_grad=p.requires_grad))
    _materialize_buffers(model, torch.device(device if device is not None else "cpu"), dtype or torch.float32)
    return model


@torch.no_grad()
def init_looped_lm_(model: nn.Module, seed: int = 0) -> None:
    """Initialise every parameter of an allocated model in place (same bits as `materialize`, whatever its
    device and dtype)."""
    for name, p in model.named_parameters():
        p.copy_(init_parameter(model.cfg, name, p.shape, seed, p.dtype, p.device))
