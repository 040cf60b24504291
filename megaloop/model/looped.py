"""The looped language model: embed -> prelude -> e -> (inject -> core) x T -> C -> coda -> head.

One class covers Parcae (diagonal injection), the additive and RDM (concat) variants and the GPT baseline
(injection none: the core runs once on e). The model holds architecture only: no process groups, no devices, no
precision recipes. Its three seams are public methods so that a pipeline can cut stages there:
  encode(ids, ctx) -> e;  loop_step(h, e, ctx) -> h';  decode(h, ctx) -> normalised hidden;  then logits()/loss.
The forward runs the ragged loop (recurrence.py): the term of e in the injection is computed once per forward and
each lap runs only the rows still looping. Activation checkpointing and compile are set by the trainer through
set_activation_checkpointing / set_compile (execution.py); a sequence-parallel runtime declares through
set_sequence_shard that e holds a slice of the sequence, so initial_state cuts h_0 from the whole sequence's draw.
With model.doc_mask the context also holds the rows' document structure (documents.py), built once per forward:
the blocks take it in place of the RoPE tables, and the loop carries it with the rows (permuted, then a prefix per
lap) like the value embeddings.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from megaloop.config.model import ModelConfig
from megaloop.model.block import Block, has_value_embedding
from megaloop.model.depth_plan import DepthPlan, host_depths
from megaloop.model.documents import Documents
from megaloop.model.execution import check_checkpoint_mode, compile_blocks, maybe_checkpoint
from megaloop.model.injection import build_injection
from megaloop.model.init import init_looped_lm_
from megaloop.model.layers import RMSNorm, rope_tables, upcast
from megaloop.model.recurrence import loop_telemetry, run_loop, run_loop_masked


@dataclass
class LoopContext:
    """Per-forward tensors shared by every loop step: RoPE tables, the core layers' value embeddings (looked up
    once from the raw ids and reused at every recurrence) and, under model.doc_mask, the rows' documents."""

    input_ids: torch.Tensor
    rope: tuple[torch.Tensor, torch.Tensor]
    core_ve: list[torch.Tensor | None] = field(default_factory=list)
    documents: Documents | None = None

    @property
    def positions(self):
        """What the blocks take for positions: the documents under doc_mask, else the RoPE tables."""
        return self.rope if self.documents is None else self.documents


@dataclass
class ModelOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor
    telemetry: dict = field(default_factory=dict)
    depth: torch.Tensor | None = None  # per-sequence T_i (CPU int64)
    grad_steps: torch.Tensor | None = None  # per-sequence k_i (CPU int64)


class LoopedLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        d, v = cfg.d_model, cfg.vocab_size
        kv_dim = cfg.kv_heads * cfg.head_dim
        cfg.require_bos()
        self.embed = nn.Embedding(v, d)
        self.value_embeds = nn.ModuleDict({
            str(i): nn.Embedding(v, kv_dim)
            for i in range(cfg.n_layers) if cfg.value_embeds and has_value_embedding(i, cfg.n_layers)
        })
        self.prelude = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_prelude))
        self.prelude_norm = RMSNorm(d, cfg.norm_eps) if cfg.prelude_norm else None
        self.injection = build_injection(cfg.injection, d)
        self.core = nn.ModuleList(Block(cfg, cfg.n_prelude + i) for i in range(cfg.n_core))
        self.C = nn.Linear(d, d, bias=False) if cfg.use_C else None
        self.coda = nn.ModuleList(Block(cfg, cfg.n_prelude + cfg.n_core + i) for i in range(cfg.n_coda))
        self.final_norm = RMSNorm(d, cfg.norm_eps)
        cos, sin = rope_tables(cfg.head_dim, cfg.seq_len, cfg.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.activation_checkpointing = "none"
        self.checkpoint_function = None  # None: torch's; an FP8 backend may set its own (maybe_checkpoint's recompute)
        self.ragged_loop = True  # False: the masked loop (every row runs max n + max k laps), for comparison
        self.sequence_parts, self.sequence_shard = 1, None  # see set_sequence_shard

    # ---- execution -----------------------------------------------------------------------------------------
    def set_execution(self, activation_checkpointing: str = "none", compile: bool = False) -> "LoopedLM":
        """train.activation_checkpointing and train.compile, in one call (returns the model)."""
        self.set_activation_checkpointing(activation_checkpointing)
        self.set_compile(compile)
        return self

    def set_activation_checkpointing(self, mode: str) -> None:
        """none | block (recompute each core block in backward) | lap (recompute each gradient lap)."""
        self.activation_checkpointing = check_checkpoint_mode(mode)

    def set_compile(self, enabled: bool, backend: str = "inductor") -> None:
        """torch.compile every prelude, core and coda block once (in place; dynamic batch dimension)."""
        if enabled:
            compile_blocks([*self.prelude, *self.core, *self.coda], backend)

    # ---- initialisation ------------------------------------------------------------------------------------
    def reset_parameters(self, seed: int = 0) -> None:
        """The reference's scaled-zero orthogonal initialisation, reproducible from `seed`."""
        init_looped_lm_(self, seed)
        cos, sin = rope_tables(self.cfg.head_dim, self.cfg.seq_len, self.cfg.rope_base, self.rope_cos.dtype)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def _apply(self, fn, recurse=True):
        """Module.to / .double() / .cuda(): the RoPE tables are a function of the config, so after a dtype change
        they are recomputed in the new dtype (an fp64 model gets fp64 angles, not fp32 ones cast up)."""
        super()._apply(fn, recurse)
        dtype = self.rope_cos.dtype
        if dtype in (torch.float32, torch.float64) and self.rope_cos.device.type != "meta":
            cos, sin = rope_tables(self.cfg.head_dim, self.cfg.seq_len, self.cfg.rope_base, dtype)
            self.rope_cos = cos.to(self.rope_cos.device)
            self.rope_sin = sin.to(self.rope_sin.device)
        return self

    # ---- seams ---------------------------------------------------------------------------------------------
    def value_embedding(self, layer: int, input_ids: torch.Tensor) -> torch.Tensor | None:
        table = self.value_embeds[str(layer)] if str(layer) in self.value_embeds else None
        return None if table is None else table(input_ids)

    def context(self, input_ids: torch.Tensor, core_values: bool = True) -> LoopContext:
        """RoPE tables for the input's length and (unless core_values is False: a pipeline stage that looks up
        only its own blocks' values) the core blocks' value embeddings."""
        s = input_ids.shape[1]
        if s > self.cfg.seq_len:
            raise ValueError(f"input has {s} positions but model.seq_len is {self.cfg.seq_len}")
        rope = (self.rope_cos[:s], self.rope_sin[:s])
        core_ve = [self.value_embedding(b.layer, input_ids) for b in self.core] if core_values else []
        documents = self.documents(input_ids) if self.cfg.doc_mask else None
        return LoopContext(input_ids, rope, core_ve, documents)

    def documents(self, input_ids: torch.Tensor) -> Documents:
        """The document structure of rows `input_ids` (model.doc_mask), with the aid the attention kernel takes:
        cu_seqlens for flash-attn and TE, a block-causal mask for sdpa and math."""
        from megaloop.model.attention import GPU_BACKENDS, resolve_attention_backend

        backend = self.core[0].attn.backend
        if backend == "auto":
            backend = resolve_attention_backend("auto", input_ids.device)
        kernel = "varlen" if backend in GPU_BACKENDS else "dense"  # GPU kernels are resolved for CUDA only
        return Documents.build(input_ids, self.cfg.bos_id, (self.rope_cos, self.rope_sin), kernel)

    def encode(self, input_ids: torch.Tensor, ctx: LoopContext) -> torch.Tensor:
        """Embedding, prelude blocks and the prelude norm: the input e that is injected at every loop step."""
        x = self.embed(input_ids)
        for block in self.prelude:
            x = block(x, ctx.positions, self.value_embedding(block.layer, input_ids))
        return self.prelude_norm(x) if self.prelude_norm is not None else x

    def loop_step(self, h: torch.Tensor, e: torch.Tensor, ctx: LoopContext) -> torch.Tensor:
        """One recurrence: u = inject(h, e); h' = Core(u). (GPT: Core(e).)"""
        x = self.injection(h, e) if self.injection is not None else e
        return self.core_pass(x, ctx.positions, ctx.core_ve)

    def core_pass(self, x: torch.Tensor, rope, core_ve) -> torch.Tensor:
        """The core blocks on x (each recomputed in backward under activation checkpointing "block"); rope: the
        RoPE tables or the rows' Documents (LoopContext.positions)."""
        per_block = self.activation_checkpointing == "block"
        for block, ve in zip(self.core, core_ve):
            x = maybe_checkpoint(per_block, block, x, rope, ve, recompute=self.checkpoint_function)
        return x

    def _lap_body(self, h, term, coeffs, cos, sin, *core_ve) -> torch.Tensor:
        return self.core_pass(self.injection(h, prepared=(term, coeffs)), (cos, sin), core_ve)

    def _lap_body_documents(self, h, term, coeffs, documents, *core_ve) -> torch.Tensor:
        return self.core_pass(self.injection(h, prepared=(term, coeffs)), documents, core_ve)

    def lap_function(self, ctx: LoopContext, coeffs):
        """lap(h, term, *core_ve) -> h' on a block of rows: the injection's per-lap step with the precomputed term
        of e, then the core (recomputed whole in backward under activation checkpointing "lap"). Under doc_mask
        the rows' documents come after the term: lap(h, term, documents, *core_ve) (see loop_rows)."""
        whole = self.activation_checkpointing == "lap"
        if ctx.documents is not None:
            def lap_documents(h, term, documents, *core_ve):
                return maybe_checkpoint(whole, self._lap_body_documents, h, term, coeffs, documents, *core_ve,
                                        recompute=self.checkpoint_function)

            return lap_documents
        cos, sin = ctx.rope

        def lap(h, term, *core_ve):
            return maybe_checkpoint(whole, self._lap_body, h, term, coeffs, cos, sin, *core_ve,
                                    recompute=self.checkpoint_function)

        return lap

    @staticmethod
    def loop_rows(ctx: LoopContext, term: torch.Tensor) -> list:
        """The per-row inputs of lap_function's lap after h: the term of e, the documents (doc_mask only), the
        core blocks' value embeddings."""
        return [term, *([] if ctx.documents is None else [ctx.documents]), *ctx.core_ve]

    def decode(self, h: torch.Tensor, ctx: LoopContext) -> torch.Tensor:
        """C projection, coda blocks and the final norm."""
        x = self.C(h) if self.C is not None else h
        for block in self.coda:
            x = block(x, ctx.positions, self.value_embedding(block.layer, ctx.input_ids))
        return self.final_norm(x)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Tied head, logits in (at least) fp32."""
        return upcast(F.linear(x, self.embed.weight))

    # ---- forward -------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, depth=None,
                backprop_depth=None, h0: torch.Tensor | None = None, noise_key=None) -> ModelOutput:
        """depth: host integers: an int (fixed T for every sequence) or per-sequence depths [B] as a list, numpy
        array or CPU integer tensor (default mu_rec; GPT: 1). backprop_depth: the number of final steps with
        gradient (None: all; int or per-sequence, host as depth). h0: initial state [B, S, d]; when None it is
        drawn from noise_key = (seed, step, sample_index [B]) (default (0, 0, arange(B))), so a sequence's h_0
        does not depend on its batch. Telemetry: see recurrence.loop_telemetry, plus rho_A (and rho_W1 for concat)
        as detached 0-dim tensors."""
        ctx = self.context(input_ids)
        e = self.encode(input_ids, ctx)
        batch = input_ids.shape[0]
        plan = DepthPlan.make(self._default_depth(depth, batch), backprop_depth, batch)
        if self.injection is None:
            h = maybe_checkpoint(self.activation_checkpointing == "lap", self.core_pass, e, ctx.positions,
                                 ctx.core_ve, recompute=self.checkpoint_function)
            telemetry = {"executed_steps": 1, "useful_steps": batch, "core_rows": batch}
        else:
            h, telemetry = self._loop(e, ctx, plan, h0, noise_key)
        logits = self.logits(self.decode(h, ctx))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        return ModelOutput(loss, logits, telemetry, torch.from_numpy(plan.total), torch.from_numpy(plan.grad))

    def _loop(self, e: torch.Tensor, ctx: LoopContext, plan: DepthPlan, h0, noise_key):
        if h0 is None:
            h0 = self.initial_state(e, noise_key)
        term, coeffs = self.injection(None, e)  # once per forward, through the module call
        lap = self.lap_function(ctx, coeffs)
        run = run_loop if self.ragged_loop else run_loop_masked
        result = run(lap, h0.to(e.dtype), self.loop_rows(ctx, term), plan)
        telemetry = loop_telemetry(result, plan)
        telemetry["rho_A"] = self.injection.rho_tensor()
        if self.cfg.injection == "concat":
            telemetry["rho_W1"] = telemetry["rho_A"]
        return result.h, telemetry

    def _default_depth(self, depth, batch: int):
        if depth is None:
            return 1 if self.injection is None else self.cfg.mu_rec
        if self.injection is None and (host_depths(depth, batch, "depth") != 1).any():
            raise ValueError("the GPT baseline (injection none) runs its blocks once: depth must be 1")
        return depth

    def set_sequence_shard(self, parts: int, shard) -> None:
        """Declare that e holds one of `parts` equal slices of the sequence (a sequence-parallel runtime sets this):
        initial_state then draws h_0 for the whole sequence and returns shard(full), this process's slice along
        dim 1, so that h_0 is the single-process one cut like e. parts=1, shard=None: e holds the whole sequence."""
        if parts < 1 or (parts > 1) != callable(shard):
            raise ValueError(f"set_sequence_shard(parts={parts}, shard={shard!r}): give parts > 1 with a callable "
                             "shard(full) -> this slice, or parts=1 with shard=None")
        self.sequence_parts, self.sequence_shard = parts, shard

    def initial_state(self, e: torch.Tensor, noise_key=None) -> torch.Tensor:
        """h_0 shaped like e, drawn per global sample from noise_key = (seed, step, sample_index [B]) (default
        (0, 0, arange(B))); for a sequence slice (set_sequence_shard) the slice of the whole sequence's draw."""
        from megaloop.depth import initial_state

        b, s, d = e.shape
        seed, step, index = noise_key if noise_key is not None else (0, 0, torch.arange(b))
        full = initial_state(b, s * self.sequence_parts, d, seed, step, index, std=self.cfg.std, device=e.device,
                             dtype=torch.float32)
        return full if self.sequence_shard is None else self.sequence_shard(full)

    def spectral_radius(self) -> float | None:
        return None if self.injection is None else self.injection.spectral_radius()
