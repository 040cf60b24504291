"""The KV cache per lap computes what the whole-sequence forward computes; adaptive depth at its limits equals
the fixed depths."""
from __future__ import annotations

import pytest
import torch

from megaloop.eval.generate import generate, generate_uncached, teacher_forced
from megaloop.eval.kv_cache import IncrementalLM
from megaloop.eval.scoring import Scorer
from tests.eval.eval_helpers import small_model


@pytest.fixture(scope="module")
def model():
    return small_model(seed=2)


@pytest.mark.parametrize("depth", [1, 3])  # T = 1 and T = mu_rec
def test_cached_greedy_equals_uncached(model, depth):
    prompt = [0, 40, 77, 101, 9]
    cached = generate(model, prompt, depth, 14, seed=5).tokens
    assert cached == generate_uncached(model, prompt, depth, 14, seed=5)
    assert len(set(cached)) > 2  # not a degenerate repetition that any bug would also produce


def test_incremental_logits_equal_full_forward(model):
    ids = torch.randint(3, 260, (2, 20), generator=torch.Generator().manual_seed(0))
    full = Scorer(model, 3, seed=1).logits(ids)
    inc = IncrementalLM(model, 3, seed=1, batch=2)
    parts = [inc.step(ids[:, :7])[0], inc.step(ids[:, 7:8])[0], inc.step(ids[:, 8:])[0]]
    assert torch.allclose(torch.cat(parts, 1), full, atol=2e-5, rtol=0)


def test_adaptive_exit_limits(model):
    rows = torch.randint(3, 260, (3, 13), generator=torch.Generator().manual_seed(1))
    fixed = {t: teacher_forced(model, rows, t, 0, None)[0] for t in (1, 3)}
    never = teacher_forced(model, rows, 3, 0, 1e-12)  # no state converges that far: every token loops 3 times
    always = teacher_forced(model, rows, 3, 0, 1e9)  # every token stops after its first lap
    assert never[1] == 3 and abs(never[0] - fixed[3]) < 1e-5
    assert always[1] == 1 and abs(always[0] - fixed[1]) < 1e-5
    assert abs(fixed[1] - fixed[3]) > 1e-3
    full = Scorer(model, 3, seed=0)  # teacher forcing through the cache = the batched forward
    assert abs(fixed[3] + sum(s.logprob for s in full.score([(r[:1].tolist(), r[1:].tolist()) for r in rows]))
               / (3 * 12)) < 1e-5
