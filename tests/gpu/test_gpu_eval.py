"""GPU-only: eval and generation on CUDA (skipped without a GPU): the KV cache per lap equals recomputation, and
the scores on CUDA equal the CPU's within float noise (h_0 drawn on the CPU for both, so only the arithmetic
differs)."""
from __future__ import annotations

import pytest

from megaloop.eval.generate import generate, generate_uncached
from megaloop.eval.scoring import Scorer
from tests.eval.eval_helpers import small_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("depth", [1, 3])
def test_cuda_cached_greedy_equals_uncached(depth):
    model = small_model(seed=2).cuda()
    prompt = [0, 40, 77, 101, 9]
    assert generate(model, prompt, depth, 14, seed=5).tokens == generate_uncached(model, prompt, depth, 14, seed=5)


def test_cuda_scores_equal_cpu():
    cpu = small_model(seed=2)
    gpu = small_model(seed=2).cuda()
    reqs = [([0, 5, 9, 12], [40, 41]), ([0, 7], [50, 51, 52, 53])]
    a, b = Scorer(cpu, 3, seed=1), Scorer(gpu, 3, seed=1)
    b._h0 = a._h0.cuda()  # the same h_0 bits: CUDA generators draw another stream
    for x, y in zip(a.score(reqs), b.score(reqs)):
        assert abs(x.logprob - y.logprob) < 1e-4
