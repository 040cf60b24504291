"""FP8 against fp32 on the looped LM's real forward and backward (shared by tests/pipeline/test_fp8.py and
benchmarks/fp8_numerics.py): SQNR of the logits and of every weight gradient, and the unrolled-copy reference."""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F

from megaloop.train.fp8 import CORE, OUTER
from pipeline.fp8 import convert_to_float8


def sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float:
    """20 log10(||ref|| / ||ref - got||) (inf when equal)."""
    noise = (ref.double() - got.double()).norm().item()
    return math.inf if noise == 0 else 20 * math.log10(ref.double().norm().item() / noise)


def nonzero_projections_(model, std: float = 0.02) -> None:
    """The reference init zeroes every block's output projections (attn.proj, mlp.proj), so an untrained model's
    blocks add nothing and FP8 would change nothing: give them N(0, std) values, like a model after some training."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("proj.weight"):
                g = torch.Generator().manual_seed(len(name))  # drawn on the CPU: the same values on every device
                p.copy_(torch.randn(p.shape, generator=g).mul_(std))


def batch(cfg, rows: int, seq: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (rows, seq + 1), generator=g)
    h0 = cfg.std * torch.randn(rows, seq, cfg.d_model, generator=g)
    return ids[:, :-1], ids[:, 1:], h0


def forward_backward(model, ids, labels, h0, depth: int, backprop: int):
    """Logits and every parameter's gradient of one looped forward/backward at `depth` with `backprop` grad laps."""
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=labels, depth=depth, backprop_depth=backprop, h0=h0)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads


def fp8_vs_fp32(model, recipe: str, ids, labels, h0, depth: int, backprop: int, outer: bool = True) -> dict:
    """SQNR (dB) of the FP8 model's logits and of its worst weight gradient against the same model in fp32."""
    ref_logits, ref_grads = forward_backward(model, ids, labels, h0, depth, backprop)
    fp8 = copy.deepcopy(model)
    report = convert_to_float8(fp8, recipe, CORE + (OUTER if outer else ()))
    logits, grads = forward_backward(fp8, ids, labels, h0, depth, backprop)
    per_param = {n: sqnr_db(ref_grads[n], grads[n]) for n in ref_grads if ref_grads[n].norm() > 0}
    worst = min(per_param, key=per_param.get)
    return {"logits": sqnr_db(ref_logits, logits), "grad": per_param[worst], "worst": worst,
            "converted": len(report.converted), "skipped": report.skipped}


def unrolled_loss(model, copies, ids, labels, h0, depth: int, backprop: int) -> torch.Tensor:
    """The loss with lap t run by copies[t] (a separate copy of the core's blocks): the first depth - backprop laps
    without autograd, the rest with it."""
    ctx = model.context(ids)
    e = model.encode(ids, ctx)
    term, coeffs = model.injection(None, e)
    core, h = model.core, h0
    try:
        for t in range(depth):
            model.core = copies[t]
            with torch.set_grad_enabled(t >= depth - backprop):
                h = model.lap_function(ctx, coeffs)(h, term, *ctx.core_ve)
    finally:
        model.core = core
    logits = model.logits(model.decode(h, ctx))
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))


def looped_vs_unrolled(model, ids, labels, h0, depth: int, backprop: int) -> dict:
    """Worst relative difference (max |a - b| / max |b|) between the looped model's gradients and the unrolled
    copies' (core: the sum over copies; every other parameter: its own), for a model whose core is in FP8."""
    model.zero_grad(set_to_none=True)
    model(ids, labels=labels, depth=depth, backprop_depth=backprop, h0=h0).loss.backward()
    looped = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    copies = [copy.deepcopy(model.core) for _ in range(depth)]
    unrolled_loss(model, copies, ids, labels, h0, depth, backprop).backward()
    errors = {}
    for name, p in model.named_parameters():
        if name.startswith("core."):
            sub = name[len("core."):]
            parts = [dict(c.named_parameters())[sub].grad for c in copies]
            ref = sum(g for g in parts if g is not None)
        else:
            ref = p.grad
        got = looped.get(name)
        if ref is None or got is None:
            errors[name] = 0.0 if ref is None and got is None else math.inf
            continue
        errors[name] = ((got - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()
    return errors
