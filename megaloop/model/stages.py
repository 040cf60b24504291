"""LoopedLM as ring-pipeline stages: a stage program (duck-typed to pipeline.ring.program.StageProgram; the model
package does not import pipeline) that computes on pp ranks exactly what LoopedLM.forward computes on one.

How a stage maps to LoopedLM's seams (core_ranges splits the core blocks into pp contiguous segments):

- embed (rank 0): context, encode -> e; `injection(None, e)` -> the term of e, permuted into the ragged plan's
  row order (deepest sequence first). The TERM is what the executor keeps and sends to every lap of rank 0, so its
  gradient accumulates over the kept laps and flows back through the injection's input weights, the prelude and
  the embedding once, at EmbedBackward, as in the forward. h_0 (given, or drawn from the noise key) is permuted the
  same way; its first active rows enter lap 0.
- lap_segment (every rank): rank 0 extends the state it receives with the h_0 rows that become active in this
  lap, recomputes the injection's coefficients (`injection(None)`: they depend on parameters only, so their
  gradient must reach the parameters from every lap) and applies `injection(h, prepared=(term rows, coeffs))`;
  every rank then runs its own core blocks with their value embeddings, looked up from the permuted ids of the
  active rows. A lap carries only its active prefix (RaggedPlan.prefix), so messages shrink to the rows still
  looping. Under model.doc_mask every rank builds the documents of the permuted rows once per micro-batch (from
  the ids, which every rank holds: nothing travels) and gives each lap its prefix.
- loss (last rank): un-permutes the rows, decode (C, coda, final norm), the tied head's logits, cross-entropy
  (ignore_index -100) times the micro-batch's scale.

The parameters a rank uses are stage_parameter_names(model, stage, pp): a rank may build the model on the meta
device and materialise only those (megaloop.train.build.held_parameters(names=...)).

The loop is always the ragged one (LoopedLM.ragged_loop True), so backprop depths must be end-aligned
(k_i = min(T_i, max k), what the trainer samples) and at least one lap must carry gradient. The GPT baseline
(injection none) is one lap: rank 0 sends e itself into the core, h_0 is unused.
"""
from __future__ import annotations

import contextlib
import numbers
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn.functional as F

from megaloop.model.depth_plan import DepthPlan, RaggedPlan
from megaloop.model.execution import maybe_checkpoint
from megaloop.model.looped import LoopedLM
from megaloop.model.transfer import to_device


SPLITS = ("even", "balanced")


def core_ranges(n_core: int, pp: int, end_costs: tuple[float, float] = (0.0, 0.0)) -> list[tuple[int, int]]:
    """The core blocks of each of pp stages as inclusive (first, last) ranges: contiguous, covering 0..n_core-1,
    each stage at least one block. end_costs: the first and the last stage's extra work in core blocks (0, 0: sizes
    differing by at most one, the earlier stages getting the extra blocks); otherwise each further block goes to
    the stage with the least work so far (ties: the one with less extra work, then the earlier), which makes the
    busiest stage as light as whole blocks allow."""
    if pp < 1:
        raise ValueError(f"the number of pipeline stages must be >= 1, got {pp}")
    if pp > n_core:
        raise ValueError(f"more pipeline stages than core blocks ({pp} > {n_core}): every stage needs at least "
                         f"one core block; use pp <= n_core (parallel.pp) or a model with more core blocks")
    extra = [0.0] * pp
    extra[0] += end_costs[0]
    extra[-1] += end_costs[1]
    sizes = [1] * pp
    for _ in range(n_core - pp):
        stage = min(range(pp), key=lambda s: (sizes[s] + extra[s], extra[s], s))
        sizes[stage] += 1
    ranges, first = [], 0
    for size in sizes:
        ranges.append((first, first + size - 1))
        first += size
    return ranges


def stage_end_costs(cfg) -> tuple[float, float]:
    """The first and last stage's extra work per micro-batch in core blocks (model config `cfg`, an estimate from
    forward FLOPs per token, backward twice the forward): a core block runs mu_rec laps forward and backprop_depth
    backward (1 + 2 per lap), a prelude or coda block once (3), the tied head 2 d V against a block's ~24 d^2."""
    core = cfg.mu_rec + 2 * cfg.backprop_depth
    head = cfg.vocab_size / (12 * cfg.d_model)
    return 3 * cfg.n_prelude / core, 3 * (cfg.n_coda + head) / core


def stage_ranges(cfg, pp: int, split: str = "even") -> list[tuple[int, int]]:
    """core_ranges for model config `cfg`: split "even" (sizes differ by at most one) or "balanced" (the end stages,
    which also run the prelude or the coda and head, get fewer core blocks: stage_end_costs)."""
    if split not in SPLITS:
        raise ValueError(f"unknown pipeline split {split!r}; use one of {SPLITS}")
    return core_ranges(cfg.n_core, pp, stage_end_costs(cfg) if split == "balanced" else (0.0, 0.0))


def stage_parameter_names(model: LoopedLM, stage: int, pp: int, split: str = "even") -> list[str]:
    """The parameters ring rank `stage` of `pp` holds, in model.named_parameters() order: rank 0 the embedding, the
    prelude, the prelude norm and the injection; every rank its core segment (stage_ranges with `split`); the last rank C, the
    coda, the final norm and the tied embedding (embed.weight is on rank 0 AND the last rank: its gradient is summed
    between the two); each block's value-embedding table goes with its block. pp 1: every parameter."""
    if not 0 <= stage < pp:
        raise ValueError(f"stage must be in 0..{pp - 1} for pp={pp}, got {stage}")
    first, last = stage_ranges(model.cfg, pp, split)[stage]
    prefixes = [f"core.{i}" for i in range(first, last + 1)]
    blocks = list(model.core[first:last + 1])
    if stage == 0:
        prefixes += ["embed", "prelude", "prelude_norm", "injection"]
        blocks += list(model.prelude)
    if stage == pp - 1:
        prefixes += ["embed", "C", "coda", "final_norm"]
        blocks += list(model.coda)
    prefixes += [f"value_embeds.{block.layer}" for block in blocks]
    return [name for name, _ in model.named_parameters()
            if any(name == p or name.startswith(p + ".") for p in prefixes)]


@dataclass(frozen=True)
class StageMicroBatch:
    """One micro-batch as LoopedLM.forward takes it: input_ids and labels [B, S]; depth and backprop_depth as host
    integers (an int or one per sequence; depth None: mu_rec, backprop_depth None: every lap); h_0 given as h0
    [B, S, d], or drawn from noise_key = (seed, step, sample_index [B]) (both None: forward's default key)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    depth: object = None
    backprop_depth: object = None
    noise_key: Optional[tuple] = None
    h0: Optional[torch.Tensor] = None


def ragged_plan(model: LoopedLM, mb: StageMicroBatch) -> RaggedPlan:
    """The ragged loop's plan for a micro-batch (GPT: one lap over every row); a clear error where the ring
    pipeline cannot run it."""
    batch = mb.input_ids.shape[0]
    plan = DepthPlan.make(model._default_depth(mb.depth, batch), mb.backprop_depth, batch)
    if model.injection is None:  # the GPT baseline's core runs once on e, with gradient
        return RaggedPlan(np.arange(batch), (batch,), 0)
    if not plan.end_aligned:
        raise ValueError(f"the ring pipeline runs the ragged loop, which needs backprop depths k_i = min(T_i, "
                         f"max k); got depths {plan.total.tolist()} and backprop depths {plan.grad.tolist()}: pass "
                         f"an int backprop_depth or the trainer's min(T_i, mu_bwd)")
    if plan.grad_steps < 1:
        raise ValueError("the ring pipeline needs at least one lap with gradient per micro-batch (backprop_depth "
                         f">= 1), got {plan.grad.tolist()}")
    return RaggedPlan.make(plan)


def micro_batch_spec(model: LoopedLM, mb: StageMicroBatch) -> dict:
    """What pipeline.ring.MicroBatch(**spec) needs to schedule the micro-batch: laps (its deepest sequence's depth),
    grad_laps (the final laps with gradient) and active (the fraction of its rows looping in each lap)."""
    plan = ragged_plan(model, mb)
    rows = mb.input_ids.shape[0]
    return {"laps": plan.laps, "grad_laps": plan.laps - plan.boundary,
            "active": tuple(p / rows for p in plan.prefix)}


class LoopedStageProgram:
    """Ring rank `stage` of `pp` for `model` (every rank builds the same full model and uses only its parts) over
    `micro_batches`; each micro-batch's loss is multiplied by `scale` (one float, e.g. 1/m, or one per micro-batch,
    e.g. the trainer's tokens / global tokens). See the module docstring.

    loss_fn(logits, labels) -> the mean token loss (default: cross-entropy ignoring -100; a tensor-parallel runtime
    passes its vocabulary-parallel one); every computation runs under `autocast()`; `split`: the core split
    (stage_ranges), as stage_parameter_names was given it; `message_dtype`: the dtype of the states that travel to
    another rank and so of their gradients (default: the parameters' dtype; a received state is cast to that on
    arrival, a state leaving for another rank to message_dtype, one staying on this rank is not cast). After a
    run, `losses[mb]` holds the last rank's unscaled losses and `telemetry(mb)` what LoopedLM.forward reports,
    each value on the rank that computes it and zero on the others (so a sum over the pipeline ranks is the
    single-process value)."""

    def __init__(self, model: LoopedLM, stage: int, pp: int, micro_batches: Sequence[StageMicroBatch],
                 scale: Union[float, Sequence[float]] = 1.0, loss_fn: Optional[Callable] = None,
                 autocast: Callable[[], ContextManager] = contextlib.nullcontext, split: str = "even",
                 message_dtype: Optional[torch.dtype] = None):
        if not 0 <= stage < pp:
            raise ValueError(f"stage must be in 0..{pp - 1} for pp={pp}, got {stage}")
        self.model, self.stage, self.pp = model, stage, pp
        first, last = stage_ranges(model.cfg, pp, split)[stage]
        self.blocks = list(model.core[first:last + 1])
        self.batches = list(micro_batches)
        single = isinstance(scale, numbers.Real)
        self.scales = [float(scale)] * len(self.batches) if single else [float(s) for s in scale]
        if len(self.scales) != len(self.batches):
            raise ValueError(f"scale must be one float or one per micro-batch ({len(self.batches)}), got "
                             f"{len(self.scales)}")
        self.loss_fn = loss_fn or _cross_entropy
        self.autocast = autocast
        self.dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        self.message = message_dtype or self.dtype
        self.plans = [ragged_plan(model, mb) for mb in self.batches]
        self._h0: dict[int, torch.Tensor] = {}  # rank 0: the permuted h_0 of micro-batches still looping
        self._prev: dict[int, torch.Tensor] = {}  # last rank: the state leaving each micro-batch's second-last lap
        self.losses: dict[int, torch.Tensor] = {}
        self._state: dict[int, dict] = {}  # last rank: state_norm and recurrent_residual of each micro-batch
        self._indices: dict[int, torch.Tensor] = {}  # plan order and inverse on the device, per micro-batch
        self._ids_in_order: dict[int, torch.Tensor] = {}
        self._documents: dict[int, object] = {}  # doc_mask: the documents of each looping micro-batch, plan order

    def specs(self) -> list[dict]:
        """micro_batch_spec of every micro-batch, in order."""
        return [micro_batch_spec(self.model, mb) for mb in self.batches]

    def _index(self, mb: int, device: torch.device) -> torch.Tensor:
        """[2, rows]: micro-batch `mb`'s plan order and its inverse on `device`, moved once per micro-batch (one
        non-blocking copy; every lap reuses it)."""
        index = self._indices.get(mb)
        if index is None or index.device != device:
            order = self.plans[mb].order
            index = self._indices[mb] = to_device(np.stack([order, np.argsort(order)]), device)
        return index

    def _permuted(self, mb: int, x: torch.Tensor) -> torch.Tensor:
        return x if self.plans[mb].is_identity else x.index_select(0, self._index(mb, x.device)[0])

    def _ids(self, mb: int) -> torch.Tensor:
        """Micro-batch `mb`'s input ids in plan order (permuted once, sliced by every lap)."""
        ids = self._ids_in_order.get(mb)
        if ids is None:
            ids = self._ids_in_order[mb] = self._permuted(mb, self.batches[mb].input_ids)
        return ids

    def embed(self, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank 0: (the kept term of e in plan order, h_0's rows active in lap 0); see the module docstring."""
        batch, model = self.batches[mb], self.model
        ids = batch.input_ids
        with self.autocast():
            e = model.encode(ids, model.context(ids, core_values=False))
            if model.injection is None:
                return e, e.detach().to(self.dtype)
            h0 = batch.h0 if batch.h0 is not None else model.initial_state(e, batch.noise_key)
            term, _ = model.injection(None, e)
        h0 = self._permuted(mb, h0.to(self.dtype))
        self._h0[mb] = h0
        return self._permuted(mb, term), h0[:self.plans[mb].prefix[0]]

    def lap_segment(self, mb: int, lap: int, h: torch.Tensor, e: Optional[torch.Tensor]) -> torch.Tensor:
        """This stage's core blocks on lap `lap`'s active rows (rank 0: after the injection)."""
        rows = self.plans[mb].prefix[lap]
        h = h.to(self.dtype)  # a received state arrives in the message dtype
        if e is not None and self.model.injection is not None:
            h0 = self._h0[mb] if lap < self.plans[mb].laps - 1 else self._h0.pop(mb)
            if h.shape[0] < rows:  # rows that start looping in this lap enter with their h_0
                h = torch.cat([h, h0[h.shape[0]:rows]])
        ids = self._ids(mb)[:rows]
        whole = self.model.activation_checkpointing == "lap"
        positions = self._positions(mb, lap, ids)
        with self.autocast():
            out = maybe_checkpoint(whole, self._segment, h, None if e is None else e[:rows], ids, positions,
                                   recompute=self.model.checkpoint_function).to(self.dtype)
        if self.stage == self.pp - 1 and lap == self.plans[mb].laps - 2:
            self._prev[mb] = out.detach()
        travels = self.pp > 1 and (self.stage < self.pp - 1 or lap < self.plans[mb].laps - 1)
        return out.to(self.message) if travels else out  # the last lap's state stays for the loss

    def _positions(self, mb: int, lap: int, ids: torch.Tensor):
        """What lap `lap`'s blocks take for positions (its rows `ids`): the RoPE tables, or under doc_mask the
        active prefix of the micro-batch's documents in plan order (built at its first lap on this rank, dropped
        after its last)."""
        if not self.model.cfg.doc_mask:
            return self.model.context(ids, core_values=False).rope
        documents = self._documents.get(mb)
        if documents is None:
            documents = self._documents[mb] = self.model.documents(self._ids(mb))
        if lap == self.plans[mb].laps - 1:
            del self._documents[mb]
        return documents.head(ids.shape[0])

    def _segment(self, h: torch.Tensor, term: Optional[torch.Tensor], ids: torch.Tensor, rope) -> torch.Tensor:
        model = self.model
        x = h
        if term is not None:
            x = term if model.injection is None else model.injection(h, prepared=(term, model.injection(None)[1]))
        per_block = model.activation_checkpointing == "block"
        for block in self.blocks:
            x = maybe_checkpoint(per_block, block, x, rope, model.value_embedding(block.layer, ids))
        return x

    def loss(self, mb: int, h: torch.Tensor) -> torch.Tensor:
        """The last rank: rows back in the caller's order, decode, logits, mean token loss times the scale."""
        batch, plan, model = self.batches[mb], self.plans[mb], self.model
        if model.injection is not None:
            self._state[mb] = self._state_telemetry(mb, h.detach())
        if not plan.is_identity:
            h = h.index_select(0, self._index(mb, h.device)[1])
        with self.autocast():
            logits = model.logits(model.decode(h, model.context(batch.input_ids, core_values=False)))
            loss = self.loss_fn(logits, batch.labels)
        self.losses[mb] = loss.detach()
        return loss * self.scales[mb]

    def _state_telemetry(self, mb: int, h: torch.Tensor) -> dict:
        """state_norm and recurrent_residual as LoopedLM.forward computes them (recurrence.loop_telemetry): h_{T-1}
        is the second-last lap's output for the rows that ran it and h_0 for rows whose only lap is the last; rows
        in plan order (the means do not depend on it)."""
        batch = self.batches[mb]
        prev = self._prev.pop(mb, h[:0])
        if prev.shape[0] < h.shape[0]:
            h0 = batch.h0 if batch.h0 is not None else self.model.initial_state(h, batch.noise_key)
            prev = torch.cat([prev, self._permuted(mb, h0.to(h.dtype))[prev.shape[0]:]])
        hd = h if h.dtype in (torch.float32, torch.float64) else h.float()
        return {"state_norm": hd.norm(dim=-1).mean(), "recurrent_residual": (hd - prev.to(hd.dtype)).norm(dim=-1).mean()}

    def telemetry(self, mb: int) -> dict:
        """Micro-batch `mb`'s telemetry with LoopedLM.forward's keys: rho_A (rho_W1) on rank 0, state_norm and
        recurrent_residual on the last rank, zero elsewhere; the lap counts and core rows on every rank."""
        plan, model = self.plans[mb], self.model
        # the ragged loop runs each row its own depth: the sum of the depths is the core rows
        out = {"executed_steps": plan.laps, "useful_steps": plan.core_rows, "core_rows": plan.core_rows}
        if model.injection is None:
            return out
        zero = torch.zeros((), dtype=torch.float64)
        out.update(self._state.pop(mb, {"state_norm": zero, "recurrent_residual": zero}))
        out["rho_A"] = model.injection.rho_tensor().detach() if self.stage == 0 else zero
        if model.cfg.injection == "concat":
            out["rho_W1"] = out["rho_A"]
        return out

    def message_shape(self, mb: int, lap: int) -> tuple[int, ...]:
        """(rows active in lap `lap`, sequence, width)."""
        _, seq = self.batches[mb].input_ids.shape
        return (self.plans[mb].prefix[lap], seq // self.model.sequence_parts, self.model.cfg.d_model)

    def message_dtype(self) -> torch.dtype:
        """The dtype of every message (the state and its gradient): message_dtype as given, else the parameters'."""
        return self.message


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
