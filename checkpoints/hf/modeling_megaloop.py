"""A megaloop looped language model for Hugging Face transformers (torch and transformers only).

Copied as it is into every folder that ``python -m checkpoints export-hf`` writes (see configuration_megaloop.py).
It computes what megaloop's LoopedLM computes at a fixed depth, operation for operation, so its logits equal
megaloop's (bit for bit on the CPU in fp32 and fp64):

    x = embed(ids); x = prelude(x); e = prelude_norm(x)
    h = h_0; repeat T times: h = core(inject(h, e))      (GPT, injection "none": h = core(e), once)
    logits = embed.weight @ final_norm(coda(C h))

Injections: diagonal (Parcae) u = A_bar * h + Delta * (B e) with A_bar = exp(-softplus(dt_bias) * exp(A_log)),
additive u = h + e, concat (RDM) u = W [h; e]. Blocks: prenorm or sandwich; MLP: relu^2 or SwiGLU; interleaved RoPE,
weightless QK-norm after RoPE, grouped KV heads and gated value embeddings looked up from the input ids.

h_0 is megaloop's evaluation draw: one truncated normal of [max_position_embeddings, d] keyed by ``h0_seed``,
position p taking row p, the same for every sequence of a batch, so a token's logits depend on neither its batch
nor its padding. ``num_steps`` (forward, generate, or the config's default) is the loop depth T.

The KV cache (a transformers DynamicCache) holds one layer per prelude block, one per coda block and one per
(lap, core block): a core block's keys and values differ from lap to lap, because the state it reads changes. A
cache is filled at one depth; feeding it at another is an error.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_megaloop import MegaloopConfig

_BELOW_ONE = 1.0 - 2.0 ** -24  # A_bar's cap: the largest float32 below 1, so rho(A_bar) < 1 in floating point
_MASK64 = (1 << 64) - 1
_EVAL_NOISE_STEP = -2  # megaloop keys its evaluation h_0 by (seed, step -2, sample 0, stream 2)
_STREAM_H0 = 2
_TRUNCATION_STDS = 3.0


# ---- h_0 ------------------------------------------------------------------------------------------------------
def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def h0_generator_seed(seed: int) -> int:
    """The torch.Generator seed of megaloop's evaluation h_0 for `seed` (SplitMix64 over the key)."""
    h = _splitmix64(int(seed) & _MASK64)
    for part in (_EVAL_NOISE_STEP, _STREAM_H0, 0):
        h = _splitmix64(h ^ (part & _MASK64))
    return h & ((1 << 63) - 1)


def initial_state(positions: int, d: int, std: float, seed: int) -> torch.Tensor:
    """[positions, d] float32 on the CPU ~ N(0, std^2) cut at +-3 std, by the inverse CDF of one uniform draw."""
    generator = torch.Generator(device="cpu").manual_seed(h0_generator_seed(seed))
    low = 0.5 * (1.0 + math.erf(-_TRUNCATION_STDS / math.sqrt(2.0)))
    values = torch.empty(positions, d, dtype=torch.float32)
    values.uniform_(2.0 * low - 1.0, 1.0 - 2.0 * low, generator=generator)
    values.erfinv_().mul_(std * math.sqrt(2.0))
    cut = _TRUNCATION_STDS * std
    return values.clamp_(-cut, cut)


# ---- layers ---------------------------------------------------------------------------------------------------
def _upcast(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = _upcast(x)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def rope_tables(head_dim: int, positions: int, base: float, dtype: torch.dtype):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=dtype) / head_dim))
    angles = torch.outer(torch.arange(positions, dtype=dtype), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate channel pairs (2j, 2j+1) of x [B, S, H, D]; cos/sin [S, D/2] (shared positions) or [B, S, D/2]."""
    pairs = _upcast(x).unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    if cos.dim() == 2:
        c, s = cos[:x.shape[1], None, :], sin[:x.shape[1], None, :]
    else:
        c, s = cos[:, :, None], sin[:, :, None]
    return torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2).type_as(x)


class MLP(nn.Module):
    """relu2: proj(0.5 relu(fc x)^2); swiglu: fc gives [gate, up], proj(silu(gate) * up)."""

    def __init__(self, d: int, hidden: int, kind: str):
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(d, 2 * hidden if kind == "swiglu" else hidden, bias=False)
        self.proj = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            gate, up = self.fc(x).chunk(2, dim=-1)
            return self.proj(F.silu(gate) * up)
        return self.proj(0.5 * F.relu(self.fc(x)).square())


@dataclass
class _Step:
    """What every attention layer of one forward shares: the RoPE rows, the cache and the key mask."""

    cos: torch.Tensor
    sin: torch.Tensor
    cache: Cache | None
    past: int  # positions already in the cache
    key_mask: torch.Tensor | None  # [B, past + s] bool, False at padding; None: no padding


class Attention(nn.Module):
    def __init__(self, config: MegaloopConfig, has_ve: bool):
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.head_dim, self.ve_gate_channels = hd, config.ve_gate_channels
        self.q = nn.Linear(d, config.num_attention_heads * hd, bias=False)
        self.k = nn.Linear(d, config.num_key_value_heads * hd, bias=False)
        self.v = nn.Linear(d, config.num_key_value_heads * hd, bias=False)
        self.proj = nn.Linear(config.num_attention_heads * hd, d, bias=False)
        self.ve_gate = nn.Linear(config.ve_gate_channels, config.num_key_value_heads, bias=False) if has_ve else None

    def forward(self, x: torch.Tensor, ve: torch.Tensor | None, step: _Step, slot: int) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, -1, self.head_dim)
        k = self.k(x).view(b, s, -1, self.head_dim)
        v = self.v(x).view(b, s, -1, self.head_dim)
        compute = q.dtype
        if self.ve_gate is not None and ve is not None:
            gate = 2.0 * torch.sigmoid(self.ve_gate(x[..., : self.ve_gate_channels]))
            v = v + gate.unsqueeze(-1) * ve.view(b, s, -1, self.head_dim)
        q = F.rms_norm(apply_rope(q, step.cos, step.sin), (self.head_dim,)).to(q.dtype)
        k = F.rms_norm(apply_rope(k, step.cos, step.sin), (self.head_dim,)).to(k.dtype)
        q, k, v = q.to(compute), k.to(compute), v.to(compute)
        if step.cache is not None:
            keys, values = step.cache.update(k.transpose(1, 2), v.transpose(1, 2), slot)
            if step.past or step.key_mask is not None:
                return self.proj(_masked_attention(q, keys, values, step).reshape(b, s, -1))
        if step.key_mask is not None:
            return self.proj(_masked_attention(q, k.transpose(1, 2), v.transpose(1, 2), step).reshape(b, s, -1))
        return self.proj(_causal_attention(q, k, v).reshape(b, s, -1))


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [B, S, H, D], k/v [B, S, Hkv, D] -> [B, S, H, D]: causal, scale 1/sqrt(D) (megaloop's whole-sequence path)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    if k.shape[2] != q.shape[2]:
        rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).transpose(1, 2)


def _masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, step: _Step) -> torch.Tensor:
    """q [B, s, H, D] at positions past..past+s-1 against keys/values [B, Hkv, past + s, D] (the cache's layout):
    causal, padding keys masked (a query always sees itself, so a padding row stays finite)."""
    s, total = q.shape[1], keys.shape[2]
    if keys.shape[1] != q.shape[2]:
        rep = q.shape[2] // keys.shape[1]
        keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
    mask = torch.ones(s, total, dtype=torch.bool, device=q.device).tril(diagonal=total - s)
    if step.key_mask is not None:
        diagonal = torch.zeros_like(mask)
        diagonal[torch.arange(s), torch.arange(total - s, total)] = True
        mask = (mask & step.key_mask[:, None, None, :total]) | diagonal
    y = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                       scale=1.0 / math.sqrt(q.shape[-1]))
    return y.transpose(1, 2)


class Block(nn.Module):
    """prenorm: x += Attn(n1 x); x += MLP(n2 x).  sandwich: x = n2(x + Attn(n1 x)); x = n4(x + MLP(n3 x))."""

    def __init__(self, config: MegaloopConfig, layer: int):
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.layer = layer
        self.sandwich = config.block == "sandwich"
        self.norm_1 = RMSNorm(d, eps)
        self.attn = Attention(config, config.has_value_embedding(layer))
        self.norm_2 = RMSNorm(d, eps)
        self.mlp = MLP(d, config.intermediate_size, config.mlp)
        if self.sandwich:
            self.norm_3 = RMSNorm(d, eps)
            self.norm_4 = RMSNorm(d, eps)

    def forward(self, x: torch.Tensor, ve, step: _Step, slot: int) -> torch.Tensor:
        if self.sandwich:
            x = self.norm_2(x + self.attn(self.norm_1(x), ve, step, slot))
            return self.norm_4(x + self.mlp(self.norm_3(x)))
        x = x + self.attn(self.norm_1(x), ve, step, slot)
        return x + self.mlp(self.norm_2(x))


# ---- injections: prepare(e) -> (term of e, coefficients), once per forward; step(h, term, coeffs) per lap --------
class DiagonalInjection(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.A_log = nn.Parameter(torch.zeros(d))
        self.dt_bias = nn.Parameter(torch.zeros(d))
        self.B = nn.Parameter(torch.eye(d))

    def discretised(self):
        delta = F.softplus(_upcast(self.dt_bias))
        a_bar = torch.exp(-delta * torch.exp(_upcast(self.A_log)))
        capped = a_bar.clamp(max=_BELOW_ONE)
        return a_bar + (capped - a_bar).detach(), delta

    def prepare(self, e: torch.Tensor):
        a_bar, delta = self.discretised()
        return delta.to(e.dtype) * (e @ self.B.t().to(e.dtype)), a_bar

    @staticmethod
    def step(h: torch.Tensor, term: torch.Tensor, a_bar: torch.Tensor) -> torch.Tensor:
        return h * a_bar.to(h.dtype) + term


class AdditiveInjection(nn.Module):
    @staticmethod
    def prepare(e: torch.Tensor):
        return e, None

    @staticmethod
    def step(h: torch.Tensor, term: torch.Tensor, _coeffs=None) -> torch.Tensor:
        return h + term


class ConcatInjection(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.d = d
        self.W = nn.Linear(2 * d, d, bias=False)

    def prepare(self, e: torch.Tensor):
        return F.linear(e, self.W.weight[:, self.d:]), None

    def step(self, h: torch.Tensor, term: torch.Tensor, _coeffs=None) -> torch.Tensor:
        return F.linear(h, self.W.weight[:, : self.d]) + term


def build_injection(kind: str, d: int):
    if kind == "none":
        return None
    if kind == "additive":
        return AdditiveInjection()
    return {"diagonal": DiagonalInjection, "concat": ConcatInjection}[kind](d)


# ---- the model ------------------------------------------------------------------------------------------------
class MegaloopPreTrainedModel(PreTrainedModel):
    config_class = MegaloopConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """A fresh model (from_config): normal weights of std sqrt(2 / (5 d)), ones for norms, the injection at
        megaloop's start (A = 1, A_bar = 1/sqrt 5, B = I). Trained weights come from the checkpoint."""
        std = self.config.h0_std
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, std)
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
        elif isinstance(module, DiagonalInjection):
            y = 0.5 * math.log(5.0)
            module.A_log.zero_()
            module.dt_bias.fill_(y + math.log(-math.expm1(-y)))
            module.B.copy_(torch.eye(module.B.shape[0]))


class MegaloopModel(MegaloopPreTrainedModel):
    """Everything but the head; forward returns the final-normed hidden states and the cache."""

    def __init__(self, config: MegaloopConfig):
        super().__init__(config)
        d, v, eps = config.hidden_size, config.vocab_size, config.rms_norm_eps
        kv_dim = config.num_key_value_heads * config.head_dim
        self.embed = nn.Embedding(v, d)
        self.value_embeds = nn.ModuleDict({str(i): nn.Embedding(v, kv_dim) for i in range(config.num_hidden_layers)
                                           if config.has_value_embedding(i)})
        self.prelude = nn.ModuleList(Block(config, i) for i in range(config.n_prelude))
        self.prelude_norm = RMSNorm(d, eps) if config.prelude_norm else None
        self.injection = build_injection(config.injection, d)
        self.core = nn.ModuleList(Block(config, config.n_prelude + i) for i in range(config.n_core))
        self.C = nn.Linear(d, d, bias=False) if config.use_C else None
        self.coda = nn.ModuleList(Block(config, config.n_prelude + config.n_core + i) for i in range(config.n_coda))
        self.final_norm = RMSNorm(d, eps)
        self._tables: dict = {}  # (dtype, device) -> RoPE cos, sin and h_0 over max_position_embeddings
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed = value

    def cache_layers(self, num_steps: int) -> int:
        """Cache layers a forward at depth `num_steps` uses (prelude, coda, then num_steps laps of the core)."""
        laps = num_steps if self.injection is not None else 1
        return self.config.n_prelude + self.config.n_coda + laps * self.config.n_core

    def _table(self, dtype: torch.dtype, device: torch.device):
        """(cos, sin, h0) as megaloop builds them: RoPE tables computed in fp64 for an fp64 model, else in fp32 and
        then cast to the model's dtype; h_0 drawn in fp32 on the CPU, then cast."""
        key = (dtype, device, self.config.h0_seed)
        if key not in self._tables:
            cfg = self.config
            cos, sin = (t.to(dtype) for t in rope_tables(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                                         dtype if dtype == torch.float64 else torch.float32))
            h0 = initial_state(cfg.max_position_embeddings, cfg.hidden_size, cfg.h0_std, cfg.h0_seed)
            self._tables[key] = (cos.to(device), sin.to(device), h0.to(device=device, dtype=dtype))
        return self._tables[key]

    def forward(self, input_ids: torch.LongTensor, num_steps: int | None = None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.LongTensor | None = None,
                past_key_values: Cache | None = None, use_cache: bool | None = None, **_ignored):
        steps = self.config.num_steps if num_steps is None else int(num_steps)
        self._check_steps(steps)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        cache = _prepared_cache(past_key_values if use_cache else None, use_cache, self.cache_layers(steps))
        past = cache.get_seq_length() if cache is not None else 0
        b, s = input_ids.shape
        if past + s > self.config.max_position_embeddings:
            raise ValueError(f"{past + s} positions: this model runs at most max_position_embeddings "
                             f"{self.config.max_position_embeddings}")
        step, h0 = self._step(input_ids, attention_mask, position_ids, cache, past)
        x = self.embed(input_ids)
        for i, block in enumerate(self.prelude):
            x = block(x, self._ve(block, input_ids), step, i)
        e = self.prelude_norm(x) if self.prelude_norm is not None else x
        h = self._loop(e, h0, input_ids, step, steps, cache, past)
        x = self.C(h) if self.C is not None else h
        for i, block in enumerate(self.coda):
            x = block(x, self._ve(block, input_ids), step, self.config.n_prelude + i)
        return self.final_norm(x), cache

    def _check_steps(self, steps: int) -> None:
        if steps < 1 or (self.injection is None and steps != 1):
            raise ValueError(f"num_steps {steps}: a looped model runs T >= 1 laps; the GPT baseline (injection "
                             "none) runs its blocks once (num_steps 1)")

    def _ve(self, block: Block, input_ids: torch.Tensor):
        table = self.value_embeds[str(block.layer)] if str(block.layer) in self.value_embeds else None
        return None if table is None else table(input_ids)

    def _step(self, input_ids, attention_mask, position_ids, cache, past: int):
        """The shared _Step and h_0 rows of this forward. Positions count from each row's first real token when a
        padding mask or position_ids are given, else from the cache's length."""
        b, s = input_ids.shape
        cos, sin, h0 = self._table(self.embed.weight.dtype, input_ids.device)
        key_mask = None
        if attention_mask is not None and not bool(attention_mask.all()):
            key_mask = attention_mask.to(torch.bool)
            if position_ids is None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)[:, -s:]
        if position_ids is None:
            return _Step(cos[past:past + s], sin[past:past + s], cache, past, None), h0[past:past + s].expand(b, -1, -1)
        position_ids = position_ids.expand(b, -1)
        return _Step(cos[position_ids], sin[position_ids], cache, past, key_mask), h0[position_ids]

    def _loop(self, e, h0, input_ids, step: _Step, steps: int, cache, past: int) -> torch.Tensor:
        core_ve = [self._ve(block, input_ids) for block in self.core]
        first = self.config.n_prelude + self.config.n_coda
        if self.injection is None:
            return self._core(e, core_ve, step, first)
        term, coeffs = self.injection.prepare(e)
        h = h0.to(e.dtype)
        for lap in range(steps):
            slot = first + lap * self.config.n_core
            if cache is not None and past and cache.get_seq_length(slot) != past:
                raise ValueError(f"the cache holds {past} positions but none for lap {lap + 1}: it was filled at "
                                 "fewer loop steps; generate with one num_steps throughout")
            h = self._core(self.injection.step(h, term, coeffs), core_ve, step, slot)
        return h

    def _core(self, x, core_ve, step: _Step, first_slot: int) -> torch.Tensor:
        for j, (block, ve) in enumerate(zip(self.core, core_ve)):
            x = block(x, ve, step, first_slot + j)
        return x


def _prepared_cache(cache, use_cache: bool, layers: int):
    """The DynamicCache to fill (a new one when use_cache and none is given), with room for `layers` layers."""
    if not use_cache:
        return None
    if cache is None:
        return DynamicCache()
    if not isinstance(cache, DynamicCache):
        raise TypeError(f"{type(cache).__name__}: the looped model keeps one cache layer per lap and needs a "
                        "DynamicCache (the default of generate())")
    if cache.layer_class_to_replicate is None:  # a cache sized from the config's layer count: add the laps
        cache.layers.extend(DynamicLayer() for _ in range(layers - len(cache.layers)))
    return cache


class MegaloopForCausalLM(MegaloopPreTrainedModel, GenerationMixin):
    """The model with its tied head: logits = final hidden @ embed.weight^T, in (at least) fp32."""

    def __init__(self, config: MegaloopConfig):
        super().__init__(config)
        self.model = MegaloopModel(config)
        self._generation_steps: int | None = None
        self.post_init()

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """Loads as transformers does, then makes generate's default depth the config's num_steps (which a load
        argument such as num_steps=16 may have changed)."""
        model = super().from_pretrained(*args, **kwargs)
        if model.generation_config is not None:
            model.generation_config.num_steps = model.config.num_steps
        return model

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed = value

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, past_key_values: Cache | None = None,
                labels: torch.LongTensor | None = None, use_cache: bool | None = None, num_steps: int | None = None,
                logits_to_keep: int = 0, **kwargs) -> CausalLMOutputWithPast:
        """input_ids [B, S] -> logits [B, S, V] at loop depth num_steps (default config.num_steps). labels: the
        input ids themselves (shifted inside, -100 ignored), as for every transformers causal LM."""
        hidden, cache = self.model(input_ids, num_steps=num_steps, attention_mask=attention_mask,
                                   position_ids=position_ids, past_key_values=past_key_values, use_cache=use_cache)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = _upcast(F.linear(hidden, self.model.embed.weight))
        loss = None
        if labels is not None:
            shifted = logits[:, :-1].reshape(-1, logits.shape[-1])
            loss = F.cross_entropy(shifted, labels[:, 1:].reshape(-1).to(logits.device), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)

    def generate(self, inputs=None, generation_config=None, num_steps: int | None = None, **kwargs):
        """transformers' generate at loop depth num_steps: the argument, else the generation config's num_steps,
        else config.num_steps."""
        config = generation_config if generation_config is not None else self.generation_config
        steps = num_steps or getattr(config, "num_steps", None) or self.config.num_steps
        self.model._check_steps(int(steps))
        previous, self._generation_steps = self._generation_steps, int(steps)
        try:
            return super().generate(inputs, generation_config=generation_config, **kwargs)
        finally:
            self._generation_steps = previous

    def prepare_inputs_for_generation(self, *args, **kwargs):
        inputs = super().prepare_inputs_for_generation(*args, **kwargs)
        inputs["num_steps"] = self._generation_steps
        return inputs
