"""Theoretical FLOPs of a looped LM (the paper's Eq. 14 plus attention); the peaks MFU divides by are in peak.py.

Per token, with S the sequence length and a sequence that runs n steps without and k steps with gradient:
  non-loop matmuls (prelude, coda, C, the tied head)   6 N_nc
  non-loop attention (QK^T and AV)                     12 d S (L_prelude + L_coda)   [full convention]
  one loop step without gradient (forward only)        2 N_loop + 4 d S L_core
  one loop step with gradient (forward + backward)     6 N_loop + 12 d S L_core
N_loop = core block weights + the injection's matrix (B or W, applied every step). Unlike the reference, the tied
head IS counted (it is a d x V matmul) and embedding / value-embedding lookups are NOT (they are gathers).
The causal convention halves the attention terms. `useful` uses each sequence's own (n_i, k_i); `executed`
uses what ran: every sequence of a micro-batch runs max(n) and max(k) steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megaloop.config.model import ModelConfig

def _block_matmul_params(cfg: ModelConfig) -> int:
    d, hd = cfg.d_model, cfg.head_dim
    attn = d * cfg.n_heads * hd * 2 + d * cfg.kv_heads * hd * 2
    mlp_in = cfg.ffn_hidden * (2 if cfg.mlp == "swiglu" else 1)
    return attn + d * mlp_in + cfg.ffn_hidden * d


@dataclass(frozen=True)
class FlopModel:
    """Per-token coefficients for one config."""

    non_loop: float  # per token, forward + backward, prelude + coda + C + head
    step_nograd: float  # per token per forward-only loop step
    step_grad: float  # per token per loop step with backward

    @staticmethod
    def of(cfg: ModelConfig, causal: bool = False) -> "FlopModel":
        d, s = cfg.d_model, cfg.seq_len
        attn = 0.5 if causal else 1.0
        blk = _block_matmul_params(cfg)
        injection = {"diagonal": d * d, "concat": 2 * d * d}.get(cfg.injection, 0)
        n_loop = cfg.n_core * blk + injection
        n_nc = (cfg.n_prelude + cfg.n_coda) * blk + (d * d if cfg.use_C else 0) + cfg.vocab_size * d
        if not cfg.is_looped:  # GPT: the core runs once, with gradient, and is part of the plain stack
            n_nc, n_loop = n_nc + n_loop, 0
            layers_nc, layers_core = cfg.n_layers, 0
        else:
            layers_nc, layers_core = cfg.n_prelude + cfg.n_coda, cfg.n_core
        return FlopModel(
            non_loop=6 * n_nc + attn * 12 * d * s * layers_nc,
            step_nograd=2 * n_loop + attn * 4 * d * s * layers_core,
            step_grad=6 * n_loop + attn * 12 * d * s * layers_core,
        )

    def integer_coefficients(self) -> tuple[int, int, int]:
        """(non_loop, step_nograd, step_grad) as integers (they are whole numbers of FLOPs per token: parameter
        counts and d * S * layers times even factors), for exact per-row costs (megaloop.depth.balance.row_costs)."""
        return tuple(int(round(c)) for c in (self.non_loop, self.step_nograd, self.step_grad))

    def per_token(self, n: float, k: float) -> float:
        return self.non_loop + n * self.step_nograd + k * self.step_grad

    def useful(self, n: torch.Tensor, k: torch.Tensor, tokens_per_seq: int) -> float:
        """Sum over sequences at their own depths."""
        return tokens_per_seq * float(self.per_token(n.double().sum(), k.double().sum()) +
                                      (len(n) - 1) * self.non_loop)

    def executed(self, n: torch.Tensor, k: torch.Tensor, tokens_per_seq: int) -> float:
        """One micro-batch as run: every sequence makes max(n) + max(k) steps."""
        return tokens_per_seq * len(n) * self.per_token(float(n.max()), float(k.max()))


def reference_flops_per_token(cfg: ModelConfig, total_params: int) -> float:
    """The official code's estimate (PARCAE_REFERENCE.md section 8), value-embedding lookups as matmuls and no head:
    kept only to check our coefficients against the published table."""
    d, s = cfg.d_model, cfg.seq_len
    norms = (4 if cfg.block == "sandwich" else 2) * d
    n_core = cfg.n_core * (_block_matmul_params(cfg) + norms)
    n_core += _ve_gate_params(cfg, range(cfg.n_prelude, cfg.n_prelude + cfg.n_core))
    n_nc = total_params - cfg.vocab_size * d - n_core
    mu, mb = cfg.mu_rec, cfg.backprop_depth
    core_attn = 4 * d * s * cfg.n_core
    if not cfg.is_looped:
        return 6 * (total_params - cfg.vocab_size * d) + 12 * d * s * cfg.n_layers
    return (6 * n_nc + 12 * d * s * (cfg.n_prelude + cfg.n_coda) + (2 * n_core + core_attn) * mu
            + (4 * n_core + 2 * core_attn) * mb)


def _ve_gate_params(cfg: ModelConfig, layers) -> int:
    from megaloop.model.block import has_value_embedding

    if not cfg.value_embeds:
        return 0
    return sum(cfg.kv_heads * cfg.ve_gate_channels for i in layers if has_value_embedding(i, cfg.n_layers))
