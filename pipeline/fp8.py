"""FP8 training of a built model's linear layers, with per-call (current) scaling and layout-free scales.

A recipe applied after the tensor-parallel split, like the split itself: each selected linear layer (nn.Linear,
ColumnParallelLinear, RowParallelLinear) is swapped for the same module with a Float8 class in front (its state is
taken over, so the parameter stays the plain `weight`: checkpoints, resharding, converters and exports see nothing
new, and a run can switch FP8 on or off at resume). Its forward runs the three GEMMs of a linear layer on
torch._scaled_mm:

    forward   y  = x  W^T     x, W in e4m3
    dgrad     dx = dy W       dy in e5m2 (tensorwise) / e4m3 (rowwise), W in e4m3
    wgrad     dW = dy^T x     the same operands, W's gradient computed in the parameter's dtype

Recipes (torchao's, whose numerics these reproduce; tests compare against torchao's Float8Linear):
  tensorwise  one scale per tensor, fp8_max / amax
  rowwise     one scale per row of each GEMM operand along its contraction dimension, rounded down to a power of 2,
              e4m3 everywhere (a tensor is re-quantized along another axis for each GEMM it takes part in)

Scales are computed at every call from the tensor itself (current scaling), which is what the loop needs: the core's
weights run T times per step, some laps without autograd, and each call is self-contained (no amax history, no
cached weight cast, nothing carried from one call to the next).

Layout-free scales. Under tensor parallelism a tensor that the layer holds split is reduced (amax, MAX) over the
tensor-parallel group before its scale is taken, so every rank's scale is the one a single process computes on the
whole tensor, bit for bit; a tensor that is whole on every rank (the column-parallel layer's input, which the
enclosing region has already gathered along the sequence under sequence parallelism; the row-parallel layer's output
gradient, likewise) needs nothing. Which operand is split along which axis:

    column-parallel (W rows split)   tensorwise: W, dy          rowwise: dgrad's dy and W (contraction over out)
    row-parallel (W columns split)   tensorwise: x, W           rowwise: forward's x and W (contraction over in)

The tokens are never split inside a linear layer, so the weight-gradient GEMM (contraction over tokens) never reduces.
Under pipeline parallelism a stage's layers are the single process's layers: nothing to do.

Scale rounding (torchao's round_scales_to_power_of_2): "auto" follows the recipe as torchao's do (tensorwise: the
scale as computed; rowwise: rounded down to a power of 2), "pow2" and "none" force it. A power-of-2 scale makes the
scaling exact (a multiplication by 2^k changes no significand) and does not move when the amax moves by an ulp.

Exact GEMMs in float64 (the precision in which layouts are proven equivalent). torch._scaled_mm on CPU accumulates
in fp32 whatever the output dtype, so a contraction split over tp ranks and summed after (row-parallel forward,
column-parallel dgrad) differs from one process's in its fp32 roundings. With a float64 output the GEMM is instead
computed exactly: the FP8 operands' values are cast to float64 (exact), multiplied in float64, and the (inverse)
scales are applied to the result. An e4m3 value is n * 2^-9 with |n| <= 448 * 2^9 < 2^17.81, so a product of two is
a multiple of 2^-18 below 2^35.62 * 2^-18, and every partial sum of K of them is a multiple of 2^-18 below
K * 2^35.62 * 2^-18: representable in float64 (53 bits) for K <= 2^17 = 131072, i.e. exact whatever the split or
order of the contraction. An e5m2 value (tensorwise's gradient) is n * 2^-16 with |n| < 2^31.81, so an e5m2 x e4m3
product is a multiple of 2^-25 below 2^49.62 * 2^-25: that guarantee holds only for K <= 10. Beyond it a sum stays
exact unless one dot product mixes products more than ~2^48 apart (factors near both formats' subnormal ends beside
factors near their maxima); such a sum is rounded in float64 (2^-53 relative) and may depend on the order, i.e. a
layout may then differ from one process by an ulp in a tensorwise dgrad (not the forward, not rowwise). With
power-of-2 scales the scaling is exact too, so a split FP8 GEMM summed over ranks gives one process's bits; with
other scales, (S0 + S1) * c and S0 * c + S1 * c may differ by an ulp.

The GEMM shapes FP8 takes: both weight dimensions multiples of 16 (layers that are not are left in high precision
and listed by the conversion); the token count is padded with zero rows to a multiple of 16 when needed (zeros change
neither an amax nor a sum).
"""
from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pipeline.collectives import exit_row_region
from pipeline.tensor_parallel import ColumnParallelLinear, RowParallelLinear, take_over

RECIPES = ("tensorwise", "rowwise")
SCALE_ROUNDINGS = ("auto", "pow2", "none")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
EPS = 1e-12  # torchao's floor under an amax (an all-zero tensor gets a finite scale)
ALIGN = 16  # FP8 GEMM dimensions must be multiples of this
LINEAR_TYPES = (nn.Linear, ColumnParallelLinear, RowParallelLinear)

# operands reduced over the tp group, per (recipe, split); roles: x, w (forward), g, wt (dgrad)
REDUCED = {
    ("tensorwise", "column"): {"w", "g"},
    ("tensorwise", "row"): {"x", "w"},
    ("rowwise", "column"): {"g", "wt"},
    ("rowwise", "row"): {"x", "w"},
}


@dataclass(frozen=True)
class Float8Settings:
    """How one layer runs in FP8: the recipe, how its weight is split over tp ("column", "row" or None) and the tp
    group (None: one process, or a layer kept whole)."""

    recipe: str
    split: str | None = None
    group: object = None
    scale_rounding: str = "auto"  # auto (the recipe's: rowwise pow2, tensorwise none) | pow2 | none

    def group_for(self, role: str):
        if self.group is None or self.split is None:
            return None
        return self.group if role in REDUCED[self.recipe, self.split] else None

    @property
    def rowwise(self) -> bool:
        return self.recipe == "rowwise"

    @property
    def pow2(self) -> bool:
        return self.scale_rounding == "pow2" or (self.scale_rounding == "auto" and self.rowwise)


def quantize(t: torch.Tensor, dtype: torch.dtype, dim: int | None, group, pow2: bool):
    """t cast to `dtype` with its scale (fp8 = saturate(t * scale)): one scale (dim None) or one per slice along
    `dim` (keepdim); the amax is reduced (MAX) over `group` first. Returns (fp8 tensor, fp32 scale)."""
    with torch.no_grad():
        amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
        amax = amax.to(torch.float64)
        if group is not None:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        fmax = torch.finfo(dtype).max
        scale = (fmax / amax.clamp(min=EPS)).to(torch.float32)
        if pow2:
            scale = torch.exp2(torch.floor(torch.log2(scale)))
        return (t.to(torch.float32) * scale).clamp(-fmax, fmax).to(dtype), scale


def column_major(t: torch.Tensor) -> torch.Tensor:
    """The same matrix stored column-major (what _scaled_mm wants for its second operand)."""
    return t.t().contiguous().t()


def scaled_mm(a, b, scale_a, scale_b, out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b from fp8 operands and their scales (dequantised by the inverse scales). CUDA's row-wise kernels write
    bf16 only: another dtype is cast from it there. A float64 output is computed exactly (module docstring)."""
    if out_dtype == torch.float64:
        return exact_mm(a, b, scale_a, scale_b)
    rowwise = scale_a.numel() > 1 or scale_b.numel() > 1
    direct = out_dtype if not (a.is_cuda and rowwise) else torch.bfloat16
    out = torch._scaled_mm(a, b, scale_a=scale_a.reciprocal(), scale_b=scale_b.reciprocal(), out_dtype=direct)
    return out.to(out_dtype)


def exact_mm(a, b, scale_a, scale_b) -> torch.Tensor:
    """a @ b in float64 from fp8 operands: the products and their sums are exact within the bounds of the module
    docstring, then the inverse scales (the ones _scaled_mm is given) are applied, a's then b's."""
    acc = a.to(torch.float64) @ b.to(torch.float64)
    return acc * scale_a.reciprocal().to(torch.float64) * scale_b.reciprocal().to(torch.float64)


class _Float8Matmul(torch.autograd.Function):
    """y = x W^T for x [M, K] (compute dtype, M a multiple of 16) and the master weight W [N, K], in FP8."""

    @staticmethod
    def forward(ctx, x, weight, settings: Float8Settings, record: dict):
        rw, pow2 = settings.rowwise, settings.pow2
        w = weight.to(x.dtype)
        xq, xs = quantize(x, E4M3, -1 if rw else None, settings.group_for("x"), pow2)
        wq, ws = quantize(w, E4M3, -1 if rw else None, settings.group_for("w"), pow2)
        y = scaled_mm(xq, wq.t(), xs, ws.t() if rw else ws, x.dtype)
        _record(record, x=xs, w=ws)
        if rw:  # re-quantized along other axes in backward: keep x and the master weight (no per-lap weight copy)
            ctx.save_for_backward(x, weight)
        else:  # tensorwise: the same casts serve the backward's GEMMs
            ctx.save_for_backward(xq, wq, xs, ws)
        ctx.settings, ctx.record, ctx.weight_dtype = settings, record, weight.dtype
        return y

    @staticmethod
    def backward(ctx, grad):
        settings, record = ctx.settings, ctx.record
        pow2 = settings.pow2
        grad = grad.contiguous()
        if settings.rowwise:
            x, weight = ctx.saved_tensors
            w = weight.to(x.dtype)
            g, gs = quantize(grad, E4M3, -1, settings.group_for("g"), pow2)
            wt, wts = quantize(w, E4M3, 0, settings.group_for("wt"), pow2)
            dx = scaled_mm(g, column_major(wt), gs, wts, x.dtype)
            gt, gts = quantize(grad, E4M3, 0, None, pow2)
            xt, xts = quantize(x, E4M3, 0, None, pow2)
            dw = scaled_mm(gt.t().contiguous(), column_major(xt), gts.t().contiguous(), xts, ctx.weight_dtype)
        else:
            xq, wq, xs, ws = ctx.saved_tensors
            g, gs = quantize(grad, E5M2, None, settings.group_for("g"), pow2)
            dx = scaled_mm(g, column_major(wq), gs, ws, grad.dtype)
            dw = scaled_mm(g.t().contiguous(), column_major(xq), gs, xs, ctx.weight_dtype)
        _record(record, g=gs)
        return dx, dw, None, None


def _record(record: dict, **scales) -> None:
    """Keep the scales of a layer's first call (forward) and first backward, and with Float8Linear.record_every_call
    every call's under "calls" (tests compare them across layouts, where a schedule may reorder the calls)."""
    for role, scale in scales.items():
        if role not in record:
            record[role] = scale.detach().clone()
        if "calls" in record:
            record["calls"].append((role, scale.detach().clone()))


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the GEMM runs in: autocast's where it is on for x's device, else x's own."""
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


def float8_linear(x: torch.Tensor, weight: torch.Tensor, settings: Float8Settings, record: dict) -> torch.Tensor:
    """x [..., K] W^T in FP8 (see the module docstring); output in the compute dtype."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k).to(compute_dtype(x))
    m = x2.shape[0]
    pad = -m % ALIGN
    if pad:
        x2 = F.pad(x2, (0, 0, 0, pad))
    y = _Float8Matmul.apply(x2, weight, settings, record)
    return y[:m].view(*x.shape[:-1], y.shape[-1])


class Float8Linear:
    """Put in front of a linear layer's class (Float8 + nn.Linear / ColumnParallelLinear / RowParallelLinear): the
    same layer, its GEMMs in FP8. `fp8` holds its Float8Settings, `fp8_scales` the scales of its first call."""

    fp8: Float8Settings
    fp8_scales: dict
    record_every_call = False  # a test hook: keep every call's scales (memory grows with the calls)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.record_every_call and "calls" not in self.fp8_scales:
            self.fp8_scales["calls"] = []
        y = float8_linear(x, self.weight, self.fp8, self.fp8_scales)
        if isinstance(self, RowParallelLinear):
            return exit_row_region(y, self.tp_group, self.sequence_parallel)
        return y


@functools.cache
def float8_class(base: type) -> type:
    return type(f"Float8{base.__name__}", (Float8Linear, base), {"__doc__": Float8Linear.__doc__})


@dataclass
class Float8Report:
    """What a conversion did: the converted layers and the skipped ones, each with the reason."""

    recipe: str
    converted: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def summary(self) -> str:
        skipped = f"; kept in high precision: {', '.join(self.skipped)}" if self.skipped else ""
        return f"fp8 {self.recipe}: {len(self.converted)} linear layers{skipped}"


def split_of(module: nn.Module) -> str | None:
    if isinstance(module, RowParallelLinear):
        return "row"
    if isinstance(module, ColumnParallelLinear):
        return "column"
    return None


def convert_to_float8(model: nn.Module, recipe: str, include: tuple[str, ...], tp_group=None,
                      scale_rounding: str = "auto") -> Float8Report:
    """Swap the linear layers of `model` whose qualified names match an fnmatch pattern of `include` for FP8 ones
    (in place; see the module docstring). tp_group: the tensor-parallel group the split layers' amaxes are reduced
    over (None: one process). Layers with a bias or a dimension that is not a multiple of 16 are skipped."""
    if recipe not in RECIPES:
        raise ValueError(f"fp8 recipe {recipe!r}: use one of {RECIPES}")
    if scale_rounding not in SCALE_ROUNDINGS:
        raise ValueError(f"fp8 scale rounding {scale_rounding!r}: use one of {SCALE_ROUNDINGS}")
    report = Float8Report(recipe)
    for name, module in list(model.named_modules()):
        if type(module) not in LINEAR_TYPES or not any(fnmatch.fnmatchcase(name, p) for p in include):
            continue
        n, k = module.weight.shape
        if module.bias is not None or n % ALIGN or k % ALIGN:
            why = "bias" if module.bias is not None else f"{k}->{n} not multiples of {ALIGN}"
            report.skipped.append(f"{name} ({why})")
            continue
        split = split_of(module)
        settings = Float8Settings(recipe, split, tp_group if split else None, scale_rounding)
        new = take_over(float8_class(type(module)), module, fp8=settings, fp8_scales={})
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, new)
        report.converted.append(name)
    return report


def float8_layers(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, Float8Linear)}


def first_scales(model: nn.Module) -> dict[str, torch.Tensor]:
    """'<layer>.<role>' -> the scale of the layer's first call (roles x, w and g)."""
    return {f"{name}.{role}": s for name, m in float8_layers(model).items() for role, s in m.fp8_scales.items()}
