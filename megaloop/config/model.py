"""The model section of the config tree: architecture, sizes, recurrence and depth sampling."""
from __future__ import annotations

import math
from dataclasses import dataclass

from megaloop.config.errors import ConfigError, check_choice

ARCHS = ("parcae", "gpt", "rdm")
INJECTIONS = ("diagonal", "additive", "concat", "none")
BLOCKS = ("prenorm", "sandwich")
MLPS = ("relu2", "swiglu")
DEPTH_SAMPLERS = (
    "fixed",
    "poisson-truncated-full",
    "poisson-truncated-full-batch",
    "poisson-lognormal-filling",
    "poisson-lognormal-filling-seq",
)
ATTN_BACKENDS = ("auto", "sdpa", "flash2", "flash3", "te", "math")


@dataclass
class ModelConfig:
    """Sizes and structure of a looped LM. Defaults are parcae-small-140m of the reference.

    arch parcae: prelude -> (injection -> core) x T -> C -> coda. gpt: the same blocks run once, no injection
    (n_prelude + n_core + n_coda layers in one stack). rdm: concatenation injection W[h; e] (Huginn).
    """

    arch: str = "parcae"
    vocab_size: int = 32768
    d_model: int = 768
    n_heads: int = 6
    n_kv_heads: int | None = None  # None: = n_heads
    n_prelude: int = 2
    n_core: int = 2
    n_coda: int = 2
    mlp: str = "relu2"
    mlp_hidden: int | None = None  # None: 4 * d_model
    block: str = "prenorm"
    injection: str = "diagonal"
    prelude_norm: bool = True
    use_C: bool = True
    value_embeds: bool = True
    ve_gate_channels: int = 32
    seq_len: int = 2048
    rope_base: float = 50000.0
    norm_eps: float = 1e-5
    init_std: float | None = None  # None: sqrt(2 / (5 d))
    attention: str = "auto"  # auto | sdpa | flash2 | flash3 | te | math: the kernel (megaloop/model/attention.py)
    mu_rec: int = 8
    mu_bwd: int | None = None  # None: ceil(mu_rec / 2)
    depth_sampler: str = "poisson-truncated-full"
    # document-aware attention (megaloop/model/documents.py): a token attends only within its document (a new one
    # at each BOS), RoPE positions restart at each document
    doc_mask: bool = False
    bos_id: int | None = None  # None: the shards' manifest tokenizer.bos_id, filled when the config is validated
    # share of a full row's attention FLOPs that document masking keeps, mean over rows of sum len_d^2 / S^2 (the
    # FLOP model's; None: measured from the local shards when the config is validated, else full rows)
    doc_attention_share: float | None = None

    # ---- derived sizes -------------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_hidden(self) -> int:
        return 4 * self.d_model if self.mlp_hidden is None else self.mlp_hidden

    @property
    def n_layers(self) -> int:
        return self.n_prelude + self.n_core + self.n_coda

    @property
    def backprop_depth(self) -> int:
        return math.ceil(self.mu_rec / 2) if self.mu_bwd is None else self.mu_bwd

    @property
    def std(self) -> float:
        return math.sqrt(2.0 / (5.0 * self.d_model)) if self.init_std is None else self.init_std

    @property
    def is_looped(self) -> bool:
        return self.injection != "none"

    def validate(self) -> None:
        """Raise ConfigError naming the first bad field and what it may be."""
        check_choice("model.arch", self.arch, ARCHS)
        check_choice("model.injection", self.injection, INJECTIONS)
        check_choice("model.block", self.block, BLOCKS)
        check_choice("model.mlp", self.mlp, MLPS)
        check_choice("model.depth_sampler", self.depth_sampler, DEPTH_SAMPLERS)
        check_choice("model.attention", self.attention, ATTN_BACKENDS)
        for name in ("vocab_size", "d_model", "n_heads", "seq_len", "n_core", "ve_gate_channels"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name}", getattr(self, name), "must be >= 1")
        for name in ("n_prelude", "n_coda"):
            if getattr(self, name) < 0:
                raise ConfigError(f"model.{name}", getattr(self, name), "must be >= 0")
        self._validate_heads()
        self._validate_recurrence()
        if self.norm_eps <= 0 or self.rope_base <= 0:
            raise ConfigError("model.norm_eps/rope_base", (self.norm_eps, self.rope_base), "must both be > 0")
        self._validate_documents()

    def _validate_documents(self) -> None:
        """doc_mask a bool, bos_id an id of the vocabulary, doc_attention_share in (0, 1] (where given)."""
        if not isinstance(self.doc_mask, bool):
            raise ConfigError("model.doc_mask", self.doc_mask, "must be true or false")
        if self.bos_id is not None and (isinstance(self.bos_id, bool) or not isinstance(self.bos_id, int)
                                        or not 0 <= self.bos_id < self.vocab_size):
            raise ConfigError("model.bos_id", self.bos_id, f"must be a token id in [0, model.vocab_size="
                              f"{self.vocab_size}) or null (taken from the shards' manifest)")
        share = self.doc_attention_share
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float))
                                  or not 0 < share <= 1):
            raise ConfigError("model.doc_attention_share", share, "must be in (0, 1] (the mean over rows of sum "
                              "len_d^2 / seq_len^2) or null (measured from the shards)")

    def require_bos(self) -> None:
        """doc_mask needs the BOS id: given, or filled from the shards' manifest when the config is validated."""
        if self.doc_mask and self.bos_id is None:
            raise ConfigError("model.bos_id", None, "model.doc_mask=true needs the BOS token id to find the "
                              "documents: set model.bos_id, or train on local shards whose manifest records "
                              "tokenizer.bos_id (it is filled from there)")

    @property
    def attention_share(self) -> float:
        """The share of full rows' attention the FLOP model counts: doc_attention_share under doc_mask (1.0 when
        not known), 1.0 without."""
        if not self.doc_mask or self.doc_attention_share is None:
            return 1.0
        return float(self.doc_attention_share)

    def _validate_heads(self) -> None:
        if self.d_model % self.n_heads:
            divisors = [h for h in range(1, min(self.d_model, 64) + 1) if self.d_model % h == 0]
            raise ConfigError("model.n_heads", self.n_heads,
                              f"must divide model.d_model={self.d_model}; allowed values include {divisors}")
        if self.head_dim % 2:
            raise ConfigError("model.n_heads", self.n_heads,
                              f"gives head_dim={self.head_dim}; RoPE needs an even head_dim")
        kv = self.kv_heads
        if kv < 1 or self.n_heads % kv:
            allowed = [h for h in range(1, self.n_heads + 1) if self.n_heads % h == 0]
            raise ConfigError("model.n_kv_heads", kv, f"must divide model.n_heads={self.n_heads}; allowed {allowed}")
        if self.value_embeds and self.ve_gate_channels > self.d_model:
            raise ConfigError("model.ve_gate_channels", self.ve_gate_channels,
                              f"must be <= model.d_model={self.d_model}")

    def _check_gpt(self) -> None:
        """arch gpt: every looped-model setting it cannot have, named at once (one at a time, the advice to fix the
        first would only lead to the next refusal)."""
        needed = {"injection": "none", "mu_rec": 1, "mu_bwd": 1, "prelude_norm": False, "use_C": False}
        wrong = [k for k, v in needed.items() if getattr(self, k) != v and not (k == "mu_bwd" and self.mu_bwd is None)]
        if wrong:
            fix = " ".join(f"model.{k}={str(needed[k]).lower() if isinstance(needed[k], bool) else needed[k]}"
                           for k in wrong)
            raise ConfigError(f"model.{wrong[0]}", getattr(self, wrong[0]), "arch gpt runs its blocks once, without "
                              f"injection, prelude norm or C projection: set {fix}")

    def _validate_recurrence(self) -> None:
        if self.mu_rec < 1:
            raise ConfigError("model.mu_rec", self.mu_rec, "the mean loop depth must be >= 1")
        if self.arch == "gpt":
            self._check_gpt()
        elif self.injection == "none":
            fits = "model.injection=concat" if self.arch == "rdm" else "model.injection=diagonal (or additive)"
            raise ConfigError("model.injection", "none", f"arch {self.arch} is looped: set {fits}")
        if self.mu_bwd is not None and not 1 <= self.mu_bwd <= self.mu_rec:
            raise ConfigError("model.mu_bwd", self.mu_bwd,
                              f"must be in [1, model.mu_rec={self.mu_rec}] (or null for ceil(mu_rec/2))")
        if self.arch == "rdm" and self.injection != "concat":
            raise ConfigError("model.injection", self.injection,
                              "arch rdm uses the concatenation injection: set model.injection=concat")
        if self.arch == "parcae" and self.injection == "concat":
            raise ConfigError("model.injection", self.injection,
                              "concat is the RDM injection: set model.arch=rdm, or model.injection=diagonal "
                              "(or additive)")

    def check_vocab_covers(self, data_vocab_size: int, source: str) -> None:
        """The embedding must hold every id the data can contain."""
        if data_vocab_size > self.vocab_size:
            raise ConfigError("model.vocab_size", self.vocab_size,
                              f"is too small for the data: {source} uses a tokenizer with {data_vocab_size} ids; "
                              f"set model.vocab_size >= {data_vocab_size}")
