"""Log-likelihood of continuations at a fixed depth T with a fixed h_0: the one scoring routine behind CORE,
LAMBADA, the lm-eval adapter and generation.

Every request (context ids, continuation ids) is scored at the same T, with h_0 the draw of the noise key
(seed, EVAL_NOISE_STEP, 0) over the model's whole seq_len, drawn on the CPU (the same on every device), cut to
the request's length: a request's score depends on neither its batch, its padding, its position in the list nor
the process count. A request longer than seq_len + 1 tokens keeps its last seq_len + 1 (the context is cut on the
left, as lm-eval does); an empty context becomes the tokenizer's BOS.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from megaloop.eval.world import World

EVAL_NOISE_STEP = -2  # trainer validation uses step -1 keyed by row; scored requests share one draw at step -2


@dataclass(frozen=True)
class Score:
    logprob: float  # sum over the continuation's tokens of log p(token | everything before)
    greedy: bool  # every continuation token is the argmax of its distribution
    tokens: int  # continuation tokens scored

    @property
    def mean_logprob(self) -> float:
        return self.logprob / max(self.tokens, 1)


class Scorer:
    """`model` (a LoopedLM, or any module with its forward(input_ids, depth=, h0=) -> .logits and .cfg) at depth
    `depth` with h_0 seed `seed`; batches of `batch_size` requests; `world` shares the batches out."""

    def __init__(self, model, depth: int, seed: int = 0, batch_size: int = 16, world: World | None = None,
                 bos_id: int = 0):
        self.model, self.depth, self.seed = model, int(depth), int(seed)
        self.batch_size, self.world, self.bos_id = int(batch_size), world or World(), bos_id
        cfg = model.cfg
        self.seq_len = cfg.seq_len
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self._h0 = None
        if cfg.injection != "none":
            from megaloop.depth import initial_state

            # Drawn on the CPU, then moved: the same h_0 (so the same scores) on every device.
            self._h0 = initial_state(1, cfg.seq_len, cfg.d_model, self.seed, EVAL_NOISE_STEP, [0], std=cfg.std,
                                     device="cpu").to(device=self.device, dtype=self.dtype)

    def h0(self, batch: int, length: int) -> torch.Tensor | None:
        """The fixed h_0 for `batch` rows of `length` positions (None for the GPT baseline)."""
        return None if self._h0 is None else self._h0[:, :length].expand(batch, -1, -1)

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """[B, S] ids -> [B, S, V] fp32 logits at this scorer's depth and h_0."""
        out = self.model(ids.to(self.device), depth=self.depth, h0=self.h0(ids.shape[0], ids.shape[1]))
        return out.logits.float()

    def _window(self, context: Sequence[int], continuation: Sequence[int]) -> tuple[list[int], int]:
        context = list(context) or [self.bos_id]
        whole = (context + list(continuation))[-(self.seq_len + 1):]
        return whole, min(len(continuation), len(whole) - 1)

    def score(self, requests: Sequence[tuple[Sequence[int], Sequence[int]]], progress=None) -> list[Score]:
        """One Score per (context ids, continuation ids), in request order (gathered over the world)."""
        windows = [self._window(c, x) for c, x in requests]
        order = sorted(range(len(windows)), key=lambda i: (-len(windows[i][0]), i))  # similar lengths batch together
        batches = [order[i:i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        results: dict[int, Score] = {}
        for b in self.world.mine(len(batches)):
            results.update(self._score_batch([windows[i] for i in batches[b]], batches[b]))
            if progress is not None:
                progress.update(len(batches[b]) * self.world.size)
        results = self.world.gather(results)
        return [results[i] for i in range(len(requests))]

    def _score_batch(self, windows, indices) -> dict[int, Score]:
        length = max(len(w) for w, _ in windows) - 1
        ids = torch.zeros(len(windows), length, dtype=torch.long)
        for row, (whole, _) in enumerate(windows):
            ids[row, :len(whole) - 1] = torch.tensor(whole[:-1])
        logprobs = F.log_softmax(self.logits(ids), dim=-1).cpu()
        out = {}
        for row, ((whole, n), index) in enumerate(zip(windows, indices)):
            end = len(whole) - 1
            lp = logprobs[row, end - n:end]
            target = torch.tensor(whole[end - n + 1:end + 1])
            picked = lp.gather(-1, target[:, None])[:, 0]
            out[index] = Score(float(picked.double().sum()), bool((lp.argmax(-1) == target).all()), n)
        return out

    def rolling(self, tokens: Sequence[int]) -> float:
        """Sum of token_logprobs (the rolling log-likelihood of a document), batched over its windows."""
        tokens = list(tokens)
        reqs = [([self.bos_id] if s == 0 else [tokens[s - 1]], tokens[s:s + self.seq_len])
                for s in range(0, len(tokens), self.seq_len)]
        return sum(s.logprob for s in self.score(reqs))
