"""Sampling from a LoopedLM at a fixed depth (KV cache per lap, or whole-sequence recomputation for reference) and
the adaptive-depth measurement: loss and mean laps per token against fixed depths at equal compute."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from megaloop.eval.kv_cache import IncrementalLM
from megaloop.eval.scoring import Scorer


@dataclass
class Generation:
    tokens: list[int]  # the new tokens
    laps: list[int]  # laps each new token's position needed (the fixed T without an exit threshold)
    prompt_laps: list[int]


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None, generator) -> int:
    """Greedy at temperature 0; else a draw from softmax(logits / temperature) over the top_k largest."""
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits.detach().cpu().double() / temperature  # the sampling generator is a CPU one
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(F.softmax(logits, -1), 1, generator=generator))


def generate(model, prompt: list[int], depth: int, max_new_tokens: int, seed: int = 0, temperature: float = 0.0,
             top_k: int | None = None, exit_threshold: float | None = None, stop: set[int] = frozenset()
             ) -> Generation:
    """Up to max_new_tokens after `prompt` (ids), with the KV cache per lap; stops at a token in `stop` or at
    seq_len."""
    inc = IncrementalLM(model, depth, seed)
    generator = torch.Generator().manual_seed(seed)
    room = model.cfg.seq_len - len(prompt)
    if room <= 0:
        raise ValueError(f"the prompt has {len(prompt)} tokens; the model runs at most seq_len "
                         f"{model.cfg.seq_len}: shorten it")
    ids = torch.tensor([prompt])
    if exit_threshold is None:
        logits, laps = inc.step(ids)
        prompt_laps = laps[0].tolist()
    else:  # adaptive depth decides per position: one position per step
        prompt_laps = []
        for p in range(len(prompt)):
            logits, laps = inc.step(ids[:, p:p + 1], exit_threshold)
            prompt_laps.append(int(laps[0, 0]))
    out, used = [], []
    for _ in range(min(max_new_tokens, room)):
        token = next_token(logits[0, -1], temperature, top_k, generator)
        out.append(token)
        if token in stop or inc.pos >= model.cfg.seq_len:
            break
        logits, laps = inc.step(torch.tensor([[token]]), exit_threshold)
        used.append(int(laps[0, -1]))
    return Generation(out, used, prompt_laps)


@torch.no_grad()
def generate_uncached(model, prompt: list[int], depth: int, max_new_tokens: int, seed: int = 0) -> list[int]:
    """Greedy generation recomputing the whole sequence for every token (the reference the cache must equal)."""
    scorer = Scorer(model, depth, seed, batch_size=1)
    ids = list(prompt)
    for _ in range(min(max_new_tokens, model.cfg.seq_len - len(prompt))):
        logits = scorer.logits(torch.tensor([ids]))
        ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt):]


@torch.no_grad()
def teacher_forced(model, rows: torch.Tensor, depth: int, seed: int, exit_threshold: float | None
                   ) -> tuple[float, float]:
    """(mean nats per token, mean laps per token) of rows [N, L + 1] fed one position at a time through the cache,
    with adaptive depth when exit_threshold is given (else every position runs `depth` laps)."""
    nats, laps, count = 0.0, 0, 0
    inc = IncrementalLM(model, depth, seed, batch=rows.shape[0])
    for p in range(rows.shape[1] - 1):
        logits, used = inc.step(rows[:, p:p + 1], exit_threshold)
        nats += float(F.cross_entropy(logits[:, 0], rows[:, p + 1].to(logits.device), reduction="sum"))
        laps += int(used.sum())
        count += rows.shape[0]
    return nats / count, laps / count


def adaptive_table(model, rows: torch.Tensor, depth: int, seed: int, thresholds, progress=None) -> dict:
    """{"fixed": {T: loss for T in 1..depth}, "adaptive": [{"eps", "mean_laps", "loss", "fixed_loss_at_equal_compute",
    "delta"}]}: fixed_loss_at_equal_compute interpolates the fixed-T losses linearly at T = mean laps."""
    fixed = {}
    for t in range(1, depth + 1):
        fixed[t] = teacher_forced(model, rows, t, seed, None)[0]
        if progress is not None:
            progress.update(1)
    table = []
    for eps in thresholds:
        loss, mean_laps = teacher_forced(model, rows, depth, seed, float(eps))
        lo = max(1, min(depth, math.floor(mean_laps)))
        hi = min(depth, lo + 1)
        equal = float(np.interp(mean_laps, [lo, hi], [fixed[lo], fixed[hi]])) if hi > lo else fixed[lo]
        table.append({"eps": float(eps), "mean_laps": mean_laps, "loss": loss, "fixed_loss_at_equal_compute": equal,
                      "delta": loss - equal})
        if progress is not None:
            progress.update(1)
    return {"fixed": fixed, "adaptive": table}
