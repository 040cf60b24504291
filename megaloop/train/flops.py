"""Theoretical FLOPs of a looped LM (the paper's Eq. 14 plus attention); the peaks MFU divides by are in peak.py.

Per token, with S the sequence length and a sequence that runs n laps without and k laps with gradient (a matmul
with an M-parameter weight costs 2M per token forward and 4M backward):
  prelude blocks, C, coda blocks, the tied head        6 N_nc
  the injection's term of e (B e; RDM: W_2 e)           6 d^2, once per forward (it does not depend on h)
  non-loop attention (QK^T and AV)                     12 d S (L_prelude + L_coda)   [full convention]
  one lap without gradient (forward only)              2 N_lap + 4 d S L_core
  one lap with gradient (forward + backward)           6 N_lap + 12 d S L_core
N_lap = the core blocks' weights (+ RDM's W_1, applied to h every lap; Parcae's per-lap A_bar h is elementwise).
Block weights include the value-embedding gates. Unlike the reference, the tied head IS counted (a d x V matmul) and
embedding / value-embedding lookups are NOT (they are gathers).

Attention conventions. The full convention (the default, what MFU divides) counts the whole S x S score and value
products: 4 d S per layer per token forward, as the Megatron-LM paper's formula (arXiv 2104.04473, appendix: the
12 s L h term per token of 72 B s L h^2 (1 + s/6h + ...)) and torchtitan's 12 L h q t per token (which states that it
ignores the causal mask's sparsity) do, and as torch.utils.flop_counter counts an unmasked kernel. The causal
convention halves the attention terms (the work a causal kernel can skip; flash-attn does skip it).

Document masking (model.doc_mask). A token attends only within its document, so a row of documents of lengths
len_d holds sum_d len_d^2 query-key pairs instead of S^2 (halved under the causal convention, as for full rows):
every attention term above is scaled by the share s = mean over rows of sum_d len_d^2 / S^2
(ModelConfig.attention_share: model.doc_attention_share, measured from the shards' train rows when the config is
validated; 1.0 without doc_mask, or when it is not known). Assumptions: the rows the run reads have the documents
of the sampled rows on average (the measure is a sample mean); the count is the work within documents, what the
varlen kernels (flash-attn, Transformer Engine) run; a dense masked kernel (sdpa) computes every pair of the row
and is charged only the pairs it keeps, so its MFU reads low, never high.

`useful` uses each sequence's own (n_i, k_i); `executed` uses what ran: every sequence of a micro-batch runs max(n)
and max(k) laps. `hardware` adds the forwards recomputed under activation checkpointing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megaloop.config.model import ModelConfig


def _block_matmul_params(cfg: ModelConfig, layer: int | None = None) -> int:
    """q/k/v/proj and the MLP of one block; with `layer`, plus its value-embedding gate if it has one."""
    d, hd = cfg.d_model, cfg.head_dim
    attn = d * cfg.n_heads * hd * 2 + d * cfg.kv_heads * hd * 2
    mlp_in = cfg.ffn_hidden * (2 if cfg.mlp == "swiglu" else 1)
    return attn + d * mlp_in + cfg.ffn_hidden * d + (0 if layer is None else _ve_gate_params(cfg, [layer]))


def _blocks(cfg: ModelConfig, first: int, count: int) -> int:
    return sum(_block_matmul_params(cfg, i) for i in range(first, first + count))


@dataclass(frozen=True)
class Component:
    """One row of the per-component split: per-token training FLOPs (forward + backward where it has gradient)."""

    name: str
    matmul: float
    attention: float = 0.0

    @property
    def total(self) -> float:
        return self.matmul + self.attention


@dataclass(frozen=True)
class FlopModel:
    """Per-token coefficients for one config, built from its parts (`parts`, see components())."""

    non_loop: float  # per token, forward + backward: prelude, injection term of e, C, coda, head
    step_nograd: float  # per token per forward-only loop step
    step_grad: float  # per token per loop step with backward
    parts: tuple = ()  # the non-loop Components and the two lap kinds, for components()

    @staticmethod
    def of(cfg: ModelConfig, causal: bool = False) -> "FlopModel":
        d, s = cfg.d_model, cfg.seq_len
        attn = (0.5 if causal else 1.0) * 4 * d * s * cfg.attention_share  # per layer per token, forward
        p, c, o = cfg.n_prelude, cfg.n_core, cfg.n_coda
        head = Component("head", 6 * cfg.vocab_size * d)
        if not cfg.is_looped:  # GPT: one plain stack, every block once with gradient
            stack = Component("blocks", 6 * _blocks(cfg, 0, cfg.n_layers), 3 * attn * cfg.n_layers)
            parts = (stack, head)
            return FlopModel(sum(x.total for x in parts), 0.0, 0.0, parts)
        once = {"diagonal": d * d, "concat": d * d}.get(cfg.injection, 0)  # B e; W_2 e
        per_lap = (d * d if cfg.injection == "concat" else 0) + _blocks(cfg, p, c)  # + W_1 h every lap
        non_loop = (Component("prelude", 6 * _blocks(cfg, 0, p), 3 * attn * p),
                    Component("injection", 6 * once),
                    Component("coda", 6 * (_blocks(cfg, p + c, o) + (d * d if cfg.use_C else 0)), 3 * attn * o),
                    head)
        lap_nograd = Component("lap (no grad)", 2 * per_lap, attn * c)
        lap_grad = Component("lap (grad)", 6 * per_lap, 3 * attn * c)
        return FlopModel(sum(x.total for x in non_loop), lap_nograd.total, lap_grad.total,
                         non_loop + (lap_nograd, lap_grad))

    def components(self, n: int, k: int) -> list[Component]:
        """The per-token split of a sequence that runs n laps without and k with gradient (GPT: n = k = 0):
        prelude, injection (its term of e, once per forward), lap 1 .. n (no grad), lap n+1 .. n+k (grad), coda
        (C and the coda blocks), head; each row's attention separately."""
        if self.step_grad == 0:
            return list(self.parts)
        prelude, injection, coda, head, lap_nograd, lap_grad = self.parts
        laps = [Component(f"lap {i + 1} (no grad)", lap_nograd.matmul, lap_nograd.attention) for i in range(n)]
        laps += [Component(f"lap {n + i + 1} (grad)", lap_grad.matmul, lap_grad.attention) for i in range(k)]
        return [prelude, injection, *laps, coda, head]

    def integer_coefficients(self) -> tuple[int, int, int]:
        """(non_loop, step_nograd, step_grad) as integers (they are whole numbers of FLOPs per token: parameter
        counts and d * S * layers times even factors; under doc_mask the attention share makes them fractions,
        rounded here), for exact per-row costs (megaloop.depth.balance.row_costs)."""
        return tuple(int(round(c)) for c in (self.non_loop, self.step_nograd, self.step_grad))

    def per_token(self, n: float, k: float) -> float:
        return self.non_loop + n * self.step_nograd + k * self.step_grad

    def recompute_per_token(self, k: float, activation_checkpointing: str) -> float:
        """The forward FLOPs run again in backward under train.activation_checkpointing ("block" and "lap" both
        recompute each lap with gradient once: a third of its forward + backward)."""
        return 0.0 if activation_checkpointing == "none" else k * self.step_grad / 3

    def useful(self, n: torch.Tensor, k: torch.Tensor, tokens_per_seq: int) -> float:
        """Sum over sequences at their own depths."""
        return tokens_per_seq * float(self.per_token(n.double().sum(), k.double().sum()) +
                                      (len(n) - 1) * self.non_loop)

    def executed(self, n: torch.Tensor, k: torch.Tensor, tokens_per_seq: int) -> float:
        """One micro-batch as run: every sequence makes max(n) + max(k) steps."""
        return tokens_per_seq * len(n) * self.per_token(float(n.max()), float(k.max()))


def fp8_shares(cfg: ModelConfig, prelude_coda: bool = False) -> tuple[float, float]:
    """(share of a lap's FLOPs, share of the non-loop FLOPs) that run in FP8 GEMMs under train.fp8: the core blocks'
    q, k, v, proj and MLP matmuls whose two dimensions are multiples of 16 (with prelude_coda, the prelude's and
    coda's too). Attention, the head, the injection and the value-embedding gates stay in bf16."""
    d, hd = cfg.d_model, cfg.head_dim
    mlp_in = cfg.ffn_hidden * (2 if cfg.mlp == "swiglu" else 1)
    shapes = [(d, cfg.n_heads * hd), (d, cfg.kv_heads * hd), (d, cfg.kv_heads * hd), (cfg.n_heads * hd, d),
              (d, mlp_in), (cfg.ffn_hidden, d)]
    per_block = sum(a * b for a, b in shapes if a % 16 == 0 and b % 16 == 0)
    fm = FlopModel.of(cfg)
    if not cfg.is_looped:  # a GPT's core blocks are part of its one stack
        blocks = cfg.n_layers if prelude_coda else cfg.n_core
        return 0.0, 6 * blocks * per_block / fm.non_loop
    lap = 2 * cfg.n_core * per_block / fm.step_nograd
    ends = 6 * (cfg.n_prelude + cfg.n_coda) * per_block / fm.non_loop if prelude_coda else 0.0
    return lap, ends


def depth_split(cfg: ModelConfig, depth: int | None = None) -> tuple[int, int]:
    """(n, k): the laps without and with gradient at depth T (default mu_rec): k = min(T, backprop depth), as the
    truncated-backprop samplers cut a sequence of depth T. GPT: (0, 0)."""
    if not cfg.is_looped:
        return 0, 0
    t = cfg.mu_rec if depth is None else depth
    k = min(t, cfg.backprop_depth)
    return t - k, k


def reference_flops_per_token(cfg: ModelConfig, total_params: int, depth: int | None = None) -> float:
    """The official code's estimate (PARCAE_REFERENCE.md section 8), value-embedding lookups as matmuls and no head:
    kept only to check our coefficients against the published table. depth: T in place of mu_rec (and
    min(T, mu_bwd) laps with gradient)."""
    d, s = cfg.d_model, cfg.seq_len
    norms = (4 if cfg.block == "sandwich" else 2) * d
    n_core = cfg.n_core * (_block_matmul_params(cfg) + norms)
    n_core += _ve_gate_params(cfg, range(cfg.n_prelude, cfg.n_prelude + cfg.n_core))
    n_nc = total_params - cfg.vocab_size * d - n_core
    mu = cfg.mu_rec if depth is None else depth
    mb = min(mu, cfg.backprop_depth)
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
