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


def _reference_adaptive(model, ids: list[int], depth: int, eps: float, seed: int):
    """Adaptive depth from its definition, with the model's own whole-sequence blocks: position p's core block j at
    lap t attends to earlier positions q through their block inputs at lap min(t, exit_q - 1) (their last lap once
    they stopped). Returns (logits [P, V], laps per position)."""
    n = len(ids)
    x_ids = torch.tensor([ids])
    ctx = model.context(x_ids)
    e = model.encode(x_ids, ctx)
    term, coeffs = model.injection(None, e)
    h0 = Scorer(model, depth, seed).h0(1, n)
    inputs = [[[None] * n for _ in model.core] for _ in range(depth)]
    exits, final = [0] * n, []
    for p in range(n):
        h = h0[:, p:p + 1]
        for t in range(depth):
            x = model.injection(h, prepared=(term[:, p:p + 1], coeffs))
            for j, block in enumerate(model.core):
                seq = [inputs[min(t, exits[q] - 1)][j][q] for q in range(p)] + [x]
                inputs[t][j][p] = x
                rope = (ctx.rope[0][:p + 1], ctx.rope[1][:p + 1])
                ve = None if ctx.core_ve[j] is None else ctx.core_ve[j][:, :p + 1]
                x = block(torch.cat(seq, 1), rope, ve)[:, -1:]
            ratio = float((x - h).norm() / x.norm())
            h = x
            if ratio < eps or t == depth - 1:
                exits[p] = t + 1
                break
        final.append(h)
    logits = model.logits(model.decode(torch.cat(final, 1), ctx))[0]
    return logits, exits


@torch.no_grad()
def test_adaptive_exit_matches_its_definition(model):
    ids = torch.randint(3, 260, (10,), generator=torch.Generator().manual_seed(6)).tolist()
    for eps in (0.6, 0.4, 0.3, 0.2, 0.1, 0.05):  # a threshold where positions stop after different laps
        inc = IncrementalLM(model, 4, seed=2)
        steps = [inc.step(torch.tensor([[i]]), eps) for i in ids]
        laps = [int(s[1][0, 0]) for s in steps]
        if len(set(laps)) >= 3:
            break
    assert len(set(laps)) >= 3, laps
    want_logits, want_laps = _reference_adaptive(model, ids, 4, eps, seed=2)
    assert laps == want_laps
    got = torch.cat([s[0][0] for s in steps])
    assert torch.allclose(got, want_logits, atol=2e-5, rtol=0)
