"""The reference's "scaled-zero" orthogonal initialisation (PARCAE_REFERENCE.md section 4), seeded.

wte, q, k, v, C, mlp.fc: truncated orthogonal with entry std ~ sigma = sqrt(2/(5d)); attn.proj and mlp.proj: zero;
norms: 1; A_log = 0, dt_bias = softplus^-1(0.5 ln 5), B = I; concat W: truncated normal (sigma, +-3 sigma);
value embeddings N(0, 1) and ve_gate torch's default kaiming-uniform, as in the reference.
"""
from __future__ import annotations

import torch
from torch import nn

from megaloop.model.injection import ConcatInjection, DiagonalInjection, dt_bias_init
from megaloop.model.layers import RMSNorm, scaled_orthogonal_


@torch.no_grad()
def init_looped_lm_(model: nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    std = model.cfg.std
    _cpu_init(model.embed.weight, lambda t: scaled_orthogonal_(t, std, g))
    for table in model.value_embeds.values():
        _cpu_init(table.weight, lambda t: nn.init.normal_(t, 0.0, 1.0, generator=g))
    for block in [*model.prelude, *model.core, *model.coda]:
        _init_block(block, std, g)
    if model.C is not None:
        _cpu_init(model.C.weight, lambda t: scaled_orthogonal_(t, std, g))
    inj = model.injection
    if isinstance(inj, DiagonalInjection):
        inj.A_log.zero_()
        inj.dt_bias.fill_(dt_bias_init())
        inj.B.copy_(torch.eye(inj.B.shape[0], dtype=inj.B.dtype))
    elif isinstance(inj, ConcatInjection):
        _cpu_init(inj.W.weight, lambda t: nn.init.trunc_normal_(t, 0.0, std, -3 * std, 3 * std, generator=g))
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.weight.fill_(1.0)


def _init_block(block: nn.Module, std: float, g: torch.Generator) -> None:
    attn = block.attn
    for lin in (attn.q, attn.k, attn.v, block.mlp.fc):
        _cpu_init(lin.weight, lambda t: scaled_orthogonal_(t, std, g))
    attn.proj.weight.zero_()
    block.mlp.proj.weight.zero_()
    if attn.ve_gate is not None:
        w = attn.ve_gate.weight
        bound = 1.0 / w.shape[1] ** 0.5  # kaiming_uniform(a=sqrt 5) of nn.Linear == U(-1/sqrt(fan_in), +)
        _cpu_init(w, lambda t: nn.init.uniform_(t, -bound, bound, generator=g))


def _cpu_init(param: torch.Tensor, fn) -> None:
    """Initialise on a CPU fp32 copy (one generator stream whatever the device), then copy in."""
    tmp = torch.empty(param.shape, dtype=torch.float32)
    fn(tmp)
    param.copy_(tmp.to(param.device, param.dtype))
