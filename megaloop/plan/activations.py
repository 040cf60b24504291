"""Activation memory of one micro-batch, counted from what autograd saves in megaloop/model (per token).

Every count below names the tensor the model code keeps for backward; `act` is the residual stream's bytes (fp32,
or fp64 under train.precision=fp64: the stream stays in the parameter dtype, bf16 autocast only touches matmuls)
and `mm` the bytes of a matmul operand (bf16 under bf16 autocast, else `act`). Per token of a prenorm block:

  RMSNorm (x2)        its input x and the normalised y (act, d each) and rsqrt (act, 1)          [s/tp under SP]
  q, k, v, fc input   bf16: one bf16 cast per linear (autocast does not share casts of activations): 4 x mm d;
                      fp32/fp64: the norm outputs themselves, 2 x act d; under SP the input is all-gathered to
                      the full sequence as a strided view, which each linear copies: 4 x mm d on full s
  value-embed gate    a cast or copy of the first ve_gate_channels (as for q), sigmoid and 2*sigmoid (kv_heads)
  RoPE + QK-norm      QK-norm input in fp32 (q + kv channels, act) and its rstd (heads + kv_heads, act)
                      (RoPE is linear in its input: it saves nothing)
  attention (SDPA)    q, k, v and the output (mm), logsumexp (heads, act); proj reads the output's memory
  MLP                 relu2: relu output and the proj input (2 x mm ffn); swiglu: fc output (2 ffn), silu output
                      and the proj input (4 x mm ffn)
  sandwich blocks     two more RMSNorms (x, y, rsqrt each)

Per kept lap the diagonal injection h * A_bar + Delta B e saves h (act d); its term Delta B e is computed once per
micro-batch (saving e, or its bf16 cast, and B e). concat saves h (or its bf16 cast) and, under bf16, a cast of
the W_1 slice (d x d) per lap. Once per micro-batch: the token ids (int64), value embeddings (act kv, computed from
the ids, shared by every lap), the prelude norm, e (act d, fp32/fp64 only), C's input, the final norm, the head's
input and the logits: the fp32 logits [b, s, V/tp] returned to the trainer, the saved (log-)softmax, and the
cross-entropy's gradients (one process: the loss gradient and the log-softmax gradient, 2 x 4 V; vocabulary-
parallel: one shifted copy in forward, the gradient is written in place).

Checkpointing (train.activation_checkpointing): `none` keeps all of the above for the k = min(T, mu_bwd) kept laps
(no-grad laps keep nothing); `block` keeps only each core block's input (act d, s/tp) per kept lap and recomputes
one block at a time in backward; `lap` keeps only each kept lap's input state h and recomputes one lap (injection
and every core block) at a time. The prelude and coda are kept in full in every setting.
"""
from __future__ import annotations

from dataclasses import dataclass

from megaloop.config import Config
from megaloop.config.model import ModelConfig
from megaloop.model.block import has_value_embedding

CHECKPOINTING = ("none", "block", "lap")


@dataclass(frozen=True)
class Sizes:
    """Per-rank sizes of one micro-batch: b sequences of s positions (s_sp of them in the sequence-parallel
    regions), local head/channel counts under tensor parallelism, and element sizes."""

    b: int
    s: int
    s_sp: int
    d: int
    q: int  # local query channels (heads x head_dim / tp)
    kv: int  # local key/value channels
    heads: int
    kv_heads: int
    ffn: int  # local MLP hidden width
    vocab: int  # local vocabulary
    act: int  # bytes of the residual stream
    mm: int  # bytes of a matmul operand

    @staticmethod
    def of(cfg: Config, b: int, tp: int, sp: bool) -> "Sizes":
        m = cfg.model
        act = 8 if cfg.train.precision == "fp64" else 4
        mm = 2 if cfg.train.precision == "bf16" else act
        s = m.seq_len
        return Sizes(b=b, s=s, s_sp=s // tp if sp else s, d=m.d_model, q=m.n_heads * m.head_dim // tp,
                     kv=m.kv_heads * m.head_dim // tp, heads=m.n_heads // tp, kv_heads=m.kv_heads // tp,
                     ffn=m.ffn_hidden // tp, vocab=m.vocab_size // tp, act=act, mm=mm)

    def full(self, per_token: float) -> int:
        """Bytes of a per-token amount over the micro-batch's full sequence."""
        return int(self.b * self.s * per_token)

    def split(self, per_token: float) -> int:
        """Bytes of a per-token amount over this rank's positions of a sequence-parallel region."""
        return int(self.b * self.s_sp * per_token)


def block_bytes(z: Sizes, m: ModelConfig, ve: bool) -> int:
    """What one block saves for backward (see the module docstring); ve: the block has a value embedding."""
    copies = z.mm < z.act or z.s_sp < z.s  # bf16 casts, or copies of the all-gathered (strided) input
    n_norms = 4 if m.block == "sandwich" else 2
    total = z.split(n_norms * (2 * z.act * z.d + z.act))
    total += z.full((4 * z.mm if copies else 2 * z.act) * z.d)
    if ve:
        total += z.full((z.mm * m.ve_gate_channels if copies else 0) + 2 * z.mm * z.kv_heads)
    total += z.full(z.act * (z.q + z.kv) + z.act * (z.heads + z.kv_heads))
    total += z.full(z.mm * (2 * z.q + 2 * z.kv) + z.act * z.heads)
    total += z.full((4 if m.mlp == "swiglu" else 2) * z.mm * z.ffn)
    return total


def block_input_bytes(z: Sizes) -> int:
    """A checkpointed block or lap keeps only its input: the residual stream."""
    return z.split(z.act * z.d)


def injection_bytes(z: Sizes, m: ModelConfig) -> int:
    """What one kept lap's injection step saves."""
    if m.injection == "diagonal":
        return z.split(z.act * z.d)
    if m.injection == "concat":
        return z.split(z.mm * z.d) + (z.mm * z.d * z.d if z.mm < z.act else 0)
    return 0


def input_term_bytes(z: Sizes, m: ModelConfig) -> int:
    """What the injection's term of e (computed once per micro-batch) saves: e or its cast, and B e."""
    if m.injection == "diagonal":
        return z.split(2 * z.mm * z.d)
    if m.injection == "concat":
        return z.split(z.mm * z.d)
    return 0


def _ve_layers(m: ModelConfig, layers) -> int:
    return sum(1 for i in layers if m.value_embeds and has_value_embedding(i, m.n_layers))


def _stack_bytes(z: Sizes, m: ModelConfig, layers) -> int:
    """A plain stack of blocks (prelude or coda) kept in full, with its value embeddings."""
    return sum(block_bytes(z, m, m.value_embeds and has_value_embedding(i, m.n_layers)) for i in layers)


@dataclass(frozen=True)
class ActivationTerms:
    """Bytes of one micro-batch on one rank. stored: held at the end of the forward; transient: the largest
    extra amount live at once during backward (recomputation or the cross-entropy's gradients)."""

    once: int  # ids, value embeddings, norms, e, C, head input (per micro-batch)
    prelude_coda: int  # the prelude and coda blocks
    laps: int  # the kept laps, as stored under the checkpointing setting
    kept_laps: int
    logits: int  # fp32 logits and the saved (log-)softmax
    output_logits: int  # one micro-batch's fp32 logits, which the trainer holds until the next forward returns
    held_logits: int  # output_logits when a rank runs more than one micro-batch per step, else 0
    weight_copies: int  # bf16 autocast copies of the matmul weights used outside recomputed regions
    loss_forward: int  # vocabulary-parallel cross-entropy's shifted copy of the logits, in the forward
    loss_backward: int  # one process: the loss and log-softmax gradients, at the start of backward
    recompute: int  # one block (block) or one lap (lap) recomputed during backward (without weight copies: the
    #                 recomputation's bf16 casts were not seen to add to the measured peak on CPU)
    working: int  # a block's backward working set: the gradients of its MLP hidden layer and residual stream

    @property
    def stored(self) -> int:
        return self.once + self.prelude_coda + self.laps + self.logits + self.weight_copies

    @property
    def transient(self) -> int:
        """The most that is live beyond `stored` at once: at the end of the forward (the previous micro-batch's
        logits and the loss's forward copy), at the start of backward (the loss gradients), or while a block is
        recomputed and differentiated."""
        return max(self.held_logits + self.loss_forward, self.loss_backward, self.recompute + self.working)

    @property
    def peak(self) -> int:
        return self.stored + self.transient


def kept_laps(m: ModelConfig) -> int:
    """Laps that keep activations: k = min(T, mu_bwd) <= mu_bwd for every sequence (GPT: its one core pass)."""
    return m.backprop_depth if m.is_looped else 1


def weight_copy_bytes(cfg: Config, params, names: str = "") -> int:
    """bf16 autocast caches one bf16 copy of every weight a matmul reads (the linears, the tied head, the
    injection's B) for the whole forward; outside bf16 there are none. `names`: only parameters starting with it.
    `params`: LocalParam list (this rank's shapes)."""
    if cfg.train.precision != "bf16":
        return 0
    return sum(2 * p.local_numel for p in params if p.name.startswith(names) and len(p.local_shape) == 2
               and not p.name.startswith("value_embeds."))


def activation_terms(cfg: Config, b: int, tp: int, sp: bool, checkpointing: str, params,
                     micro_batches: int = 1) -> ActivationTerms:
    """The activation memory of a micro-batch of b sequences on one rank (see the module docstring); `params`:
    this rank's LocalParam list (for the autocast weight copies); micro_batches: per rank and step (from the
    second one on, the trainer still holds the previous micro-batch's output while the next forward runs)."""
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"activation checkpointing {checkpointing!r}: allowed {CHECKPOINTING}")
    m, z = cfg.model, Sizes.of(cfg, b, tp, sp)
    pre = range(m.n_prelude)
    core = range(m.n_prelude, m.n_prelude + m.n_core)
    coda = range(m.n_prelude + m.n_core, m.n_layers)
    once = z.full(8) + z.full(z.act * z.kv) * _ve_layers(m, core)
    norm = 2 * z.act * z.d + z.act
    once += z.split(norm * (2 if m.prelude_norm else 1))  # the prelude norm and the final norm
    once += input_term_bytes(z, m)
    once += z.split(z.mm * z.d) if m.use_C else 0  # C's input
    once += z.full(z.mm * z.d)  # the head's (gathered) input
    k = kept_laps(m)
    one_lap = injection_bytes(z, m) + _stack_bytes(z, m, core)
    copies, core_copies = weight_copy_bytes(cfg, params), weight_copy_bytes(cfg, params, "core.")
    if checkpointing == "none":
        laps, recompute = k * one_lap, 0
    elif checkpointing == "block":
        laps = k * (injection_bytes(z, m) + m.n_core * block_input_bytes(z))
        recompute = max(block_bytes(z, m, m.value_embeds and has_value_embedding(i, m.n_layers)) for i in core)
        copies -= core_copies
    else:
        laps, recompute = k * block_input_bytes(z), one_lap
        copies -= core_copies
    logits = z.full(2 * z.act * z.vocab)
    one = z.full(z.act * z.vocab)
    return ActivationTerms(once=once, prelude_coda=_stack_bytes(z, m, pre) + _stack_bytes(z, m, coda), laps=laps,
                           kept_laps=k, logits=logits, output_logits=one, held_logits=one * (micro_batches > 1),
                           weight_copies=copies, loss_forward=one * (tp > 1), loss_backward=2 * one * (tp == 1),
                           recompute=recompute, working=z.full(z.mm * z.ffn + z.act * z.d))
