"""Transformer blocks: the reference pre-norm block and Huginn's sandwich block."""
from __future__ import annotations

import torch
from torch import nn

from megaloop.config.model import ModelConfig
from megaloop.model.attention import Attention
from megaloop.model.layers import ReluSquaredMLP, RMSNorm, SwiGLUMLP


def has_value_embedding(layer: int, n_layers: int) -> bool:
    """The reference's rule over the effective layers (prelude, core, coda): alternate, the last one always."""
    return layer % 2 == (n_layers - 1) % 2


class Block(nn.Module):
    """prenorm: x += Attn(n1 x); x += MLP(n2 x).  sandwich: x = n2(x + Attn(n1 x)); x = n4(x + MLP(n3 x))."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        d, eps = cfg.d_model, cfg.norm_eps
        self.layer = layer
        self.has_ve = cfg.value_embeds and has_value_embedding(layer, cfg.n_layers)
        self.sandwich = cfg.block == "sandwich"
        self.norm_1 = RMSNorm(d, eps)
        self.attn = Attention(d, cfg.n_heads, cfg.kv_heads, self.has_ve, cfg.ve_gate_channels, cfg.attention)
        self.norm_2 = RMSNorm(d, eps)
        mlp_cls = ReluSquaredMLP if cfg.mlp == "relu2" else SwiGLUMLP
        self.mlp = mlp_cls(d, cfg.ffn_hidden)
        if self.sandwich:
            self.norm_3 = RMSNorm(d, eps)
            self.norm_4 = RMSNorm(d, eps)

    def forward(self, x: torch.Tensor, rope, ve: torch.Tensor | None = None) -> torch.Tensor:
        if self.sandwich:
            x = self.norm_2(x + self.attn(self.norm_1(x), rope, ve))
            return self.norm_4(x + self.mlp(self.norm_3(x)))
        x = x + self.attn(self.norm_1(x), rope, ve)
        return x + self.mlp(self.norm_2(x))
