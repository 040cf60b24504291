"""Incremental decoding of a LoopedLM with a KV cache per lap, and adaptive depth per token.

The keys and values of a core block differ from lap to lap (the state it reads changes), so the cache holds one
entry per (lap, core block), plus one per prelude and coda block. Feeding tokens at positions [p, p + s) computes
exactly what the whole-sequence forward computes at those positions at depth T with the fixed h_0 of
megaloop.eval.scoring (the draw of (seed, -2, 0) over seq_len, position p taking row p).

Adaptive depth (`exit_threshold` eps): a position stops looping after lap t once ||h_t - h_{t-1}|| / ||h_t|| < eps
(or at the maximum depth T). Its later laps' cache entries are filled with those of its last lap, so later tokens
attending to it at lap t' > t see the state it stopped at (what Huginn does with its cache). A row that has exited
keeps its state while the others of the batch loop on; `laps` reports the laps each position needed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megaloop.model.layers import apply_rope_interleaved, rms_norm_weightless


@dataclass
class KV:
    k: torch.Tensor  # [B, S_max, Hkv, D]
    v: torch.Tensor


class IncrementalLM:
    """`model` at maximum depth `depth` with h_0 seed `seed`, for `batch` sequences of up to seq_len tokens."""

    def __init__(self, model, depth: int, seed: int = 0, batch: int = 1):
        from megaloop.eval.scoring import Scorer

        self.model, self.depth = model, int(depth)
        self.looped = model.injection is not None
        self.laps = self.depth if self.looped else 1
        scorer = Scorer(model, depth, seed)
        self.h0_full = scorer.h0(batch, model.cfg.seq_len)
        self.batch, self.pos = batch, 0
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        cfg = model.cfg
        shape = (batch, cfg.seq_len, cfg.kv_heads, cfg.head_dim)

        def kv():
            return KV(torch.zeros(shape, device=self.device, dtype=self.dtype),
                      torch.zeros(shape, device=self.device, dtype=self.dtype))

        self.prelude = [kv() for _ in model.prelude]
        self.core = [[kv() for _ in model.core] for _ in range(self.laps)]
        self.coda = [kv() for _ in model.coda]

    @torch.no_grad()
    def step(self, ids: torch.Tensor, exit_threshold: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed ids [B, s] at the next s positions: (logits [B, s, V] fp32, laps used [B, s] int64)."""
        model, s = self.model, ids.shape[1]
        start, end = self.pos, self.pos + s
        if end > model.cfg.seq_len:
            raise ValueError(f"the sequence would reach {end} positions; the model runs at most seq_len "
                             f"{model.cfg.seq_len}")
        ids = ids.to(self.device)
        cos, sin = model.rope_cos[start:end], model.rope_sin[start:end]
        x = model.embed(ids)
        for block, kv in zip(model.prelude, self.prelude):
            x = _block(block, x, cos, sin, model.value_embedding(block.layer, ids), kv, start)
        e = model.prelude_norm(x) if model.prelude_norm is not None else x
        ve = [model.value_embedding(b.layer, ids) for b in model.core]
        laps = torch.full((ids.shape[0], s), self.laps, dtype=torch.long)
        if not self.looped:
            h = self._core(e, cos, sin, ve, 0, start)
        else:
            h = self._loop(e, cos, sin, ve, start, exit_threshold, laps)
        x = model.C(h) if model.C is not None else h
        for block, kv in zip(model.coda, self.coda):
            x = _block(block, x, cos, sin, model.value_embedding(block.layer, ids), kv, start)
        self.pos = end
        return model.logits(model.final_norm(x)).float(), laps

    def _core(self, x, cos, sin, ve, lap: int, start: int):
        for block, v, kv in zip(self.model.core, ve, self.core[lap]):
            x = _block(block, x, cos, sin, v, kv, start)
        return x

    def _loop(self, e, cos, sin, ve, start, eps, laps):
        model, end = self.model, start + e.shape[1]
        if eps is not None and e.shape[1] != 1:
            raise ValueError("adaptive depth feeds one position per step; give ids of shape [B, 1]")
        term, coeffs = model.injection(None, e)
        h = self.h0_full[:, start:end].to(e.dtype)
        active = torch.ones(laps.shape, dtype=torch.bool, device=e.device)
        stopped = []  # (lap, positions that stopped after it)
        for lap in range(self.laps):
            new = self._core(model.injection(h, prepared=(term, coeffs)), cos, sin, ve, lap, start)
            if eps is None:
                h = new
                continue
            h_next = torch.where(active[..., None], new, h)
            ratio = (h_next - h).float().norm(dim=-1) / h_next.float().norm(dim=-1).clamp_min(1e-30)
            stopping = active & (ratio < eps)
            h = h_next
            if lap < self.laps - 1 and stopping.any():
                laps[stopping.cpu()] = lap + 1
                stopped.append((lap, stopping))
            active = active & ~stopping
            if not active.any():
                break
        for lap, stopping in stopped:  # after the loop: later laps wrote entries for rows that had stopped
            self._carry(lap, start, stopping)
        return h

    def _carry(self, lap: int, start: int, stopping: torch.Tensor) -> None:
        """Copy lap `lap`'s cache entries of the positions stopping now into every later lap."""
        rows, cols = stopping.nonzero(as_tuple=True)
        cols = cols + start
        for later in range(lap + 1, self.laps):
            for src, dst in zip(self.core[lap], self.core[later]):
                dst.k[rows, cols] = src.k[rows, cols]
                dst.v[rows, cols] = src.v[rows, cols]


def _block(block, x, cos, sin, ve, kv: KV, start: int):
    """Block.forward on new positions with a cache (prenorm and sandwich)."""
    if block.sandwich:
        x = block.norm_2(x + _attention(block.attn, block.norm_1(x), cos, sin, ve, kv, start))
        return block.norm_4(x + block.mlp(block.norm_3(x)))
    x = x + _attention(block.attn, block.norm_1(x), cos, sin, ve, kv, start)
    return x + block.mlp(block.norm_2(x))


def _attention(attn, x, cos, sin, ve, kv: KV, start: int):
    """Attention.forward for positions [start, start + s) against the cache (which it extends)."""
    b, s, _ = x.shape
    q = attn.q(x).view(b, s, -1, attn.head_dim)
    k = attn.k(x).view(b, s, -1, attn.head_dim)
    v = attn.v(x).view(b, s, -1, attn.head_dim)
    if attn.ve_gate is not None and ve is not None:
        gate = 2.0 * torch.sigmoid(attn.ve_gate(x[..., : attn.ve_gate_channels]))
        v = v + gate.unsqueeze(-1) * ve.view(b, s, -1, attn.head_dim)
    q = rms_norm_weightless(apply_rope_interleaved(q, cos, sin))
    k = rms_norm_weightless(apply_rope_interleaved(k, cos, sin))
    end = start + s
    kv.k[:, start:end], kv.v[:, start:end] = k, v
    keys, values = kv.k[:, :end], kv.v[:, :end]
    if keys.shape[2] != q.shape[2]:
        rep = q.shape[2] // keys.shape[2]
        keys, values = keys.repeat_interleave(rep, dim=2), values.repeat_interleave(rep, dim=2)
    mask = torch.ones(s, end, dtype=torch.bool, device=x.device).tril(diagonal=start)
    y = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                       attn_mask=mask, scale=attn.head_dim ** -0.5).transpose(1, 2)
    return attn.proj(y.reshape(b, s, -1))
