"""MegaloopConfig: a megaloop looped language model's hyperparameters, for Hugging Face transformers.

This file and modeling_megaloop.py are copied as they are into every folder that
``python -m checkpoints export-hf`` writes; they import only torch and transformers, so the folder loads with
``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` on a machine without megaloop.

The model is prelude -> (inject -> core) x T -> C -> coda -> tied head. ``num_steps`` is the loop depth T a
forward runs when it is not given one (default mu_rec, the training mean); the GPT baseline (injection "none")
runs its blocks once. ``h0_seed`` keys the fixed initial loop state h_0 (megaloop's evaluation draw), so that
logits are a pure function of the weights, the input and T. Any field can be overridden at load time, e.g.
``from_pretrained(DIR, trust_remote_code=True, num_steps=16)``.
"""
from __future__ import annotations

import math

from transformers import PretrainedConfig

INJECTIONS = ("diagonal", "additive", "concat", "none")
BLOCKS = ("prenorm", "sandwich")
MLPS = ("relu2", "swiglu")


class MegaloopConfig(PretrainedConfig):
    model_type = "megaloop"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, vocab_size: int = 32768, hidden_size: int = 768, num_attention_heads: int = 6,
                 num_key_value_heads: int | None = None, intermediate_size: int | None = None, n_prelude: int = 2,
                 n_core: int = 2, n_coda: int = 2, injection: str = "diagonal", block: str = "prenorm",
                 mlp: str = "relu2", prelude_norm: bool = True, use_C: bool = True, value_embeds: bool = True,
                 ve_gate_channels: int = 32, max_position_embeddings: int = 2048, rope_theta: float = 50000.0,
                 rms_norm_eps: float = 1e-5, init_std: float | None = None, mu_rec: int = 8,
                 num_steps: int | None = None, h0_seed: int = 0, use_cache: bool = True,
                 tie_word_embeddings: bool = True, bos_token_id: int | None = 0, eos_token_id: int | None = 1,
                 pad_token_id: int | None = 2,
                 **kwargs):
        kwargs.pop("num_hidden_layers", None)  # derived below
        self.vocab_size, self.hidden_size = int(vocab_size), int(hidden_size)
        self.num_attention_heads = int(num_attention_heads)
        self.num_key_value_heads = int(num_key_value_heads or num_attention_heads)
        self.intermediate_size = int(intermediate_size or 4 * hidden_size)
        self.n_prelude, self.n_core, self.n_coda = int(n_prelude), int(n_core), int(n_coda)
        self.injection, self.block, self.mlp = injection, block, mlp
        self.prelude_norm, self.use_C, self.value_embeds = bool(prelude_norm), bool(use_C), bool(value_embeds)
        self.ve_gate_channels = int(ve_gate_channels)
        self.max_position_embeddings = int(max_position_embeddings)
        self.rope_theta, self.rms_norm_eps = float(rope_theta), float(rms_norm_eps)
        self.init_std = init_std
        self.mu_rec = int(mu_rec)
        self.num_steps = int(num_steps) if num_steps is not None else (self.mu_rec if injection != "none" else 1)
        self.h0_seed = int(h0_seed)
        self.use_cache = bool(use_cache)
        self.num_hidden_layers = self.n_prelude + self.n_core + self.n_coda
        self._check()
        super().__init__(tie_word_embeddings=tie_word_embeddings, bos_token_id=bos_token_id,
                         eos_token_id=eos_token_id, pad_token_id=pad_token_id, **kwargs)

    def _check(self) -> None:
        for name, value, allowed in (("injection", self.injection, INJECTIONS), ("block", self.block, BLOCKS),
                                     ("mlp", self.mlp, MLPS)):
            if value not in allowed:
                raise ValueError(f"MegaloopConfig.{name}={value!r}: allowed {', '.join(allowed)}")
        if self.hidden_size % self.num_attention_heads or (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError(f"hidden_size {self.hidden_size} must split into {self.num_attention_heads} heads of "
                             "an even size (RoPE rotates channel pairs)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_key_value_heads {self.num_key_value_heads} must divide num_attention_heads "
                             f"{self.num_attention_heads}")
        if self.num_steps < 1 or (self.injection == "none" and self.num_steps != 1):
            raise ValueError(f"num_steps {self.num_steps}: a looped model runs T >= 1 laps; the GPT baseline "
                             "(injection none) runs its blocks once (num_steps 1)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def h0_std(self) -> float:
        """The standard deviation of h_0 before truncation: init_std, else sqrt(2 / (5 d))."""
        return math.sqrt(2.0 / (5.0 * self.hidden_size)) if self.init_std is None else float(self.init_std)

    def has_value_embedding(self, layer: int) -> bool:
        """Layers are numbered over prelude, core and coda; every other one has a value embedding, the last always."""
        return self.value_embeds and layer % 2 == (self.num_hidden_layers - 1) % 2
