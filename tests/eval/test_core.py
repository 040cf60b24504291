"""CORE: prompts as tasks_v0.3.yaml gives them, the three formats judged on hand-made scores, centered accuracy
and its chance computed by hand, deterministic few-shot sampling, and a random-logits model at chance."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from megaloop.eval import core
from megaloop.eval.scoring import Score

MC = core.TaskSpec("mc", "mc", "mc.jsonl", "multiple_choice", 1, "\nAnswer: ")
SCHEMA = core.TaskSpec("wino", "wino", "w.jsonl", "schema", 0)
LM = core.TaskSpec("lm", "lm", "l.jsonl", "language_modeling", 0)


class FixedScorer:
    """Returns the given Scores in order (stands for the model)."""

    def __init__(self, scores):
        self.scores = list(scores)

    def score(self, requests, progress=None):
        assert len(requests) == len(self.scores)
        return self.scores


class CharTok:
    def encode(self, text):
        return [ord(c) for c in text]


def _s(lp, n=1, greedy=False):
    return Score(lp, greedy, n)


def test_multiple_choice_by_hand():
    examples = [{"query": "Q1", "choices": ["a", "b", "c", "d"], "gold": 1},
                {"query": "Q2", "choices": ["x", "y"], "gold": 0}]
    ctx, cont = core.prompts(MC, examples, 0, seed=0)[1]
    assert ctx == "Q2\nAnswer: x\nQ1\nAnswer:" and cont == " b"  # 1 shot (the only other example), space moved
    # example 1: choice 1 has the best MEAN (-2/4 = -0.5 beats -1.0 over 1 token) though not the best sum
    scores = [_s(-1.0), _s(-2.0, 4), _s(-3.0), _s(-4.0), _s(-0.1), _s(-0.2)]
    r = core.score_task(FixedScorer(scores), CharTok(), MC, examples, seed=0)
    assert (r.correct, r.examples) == (2, 2)
    assert r.chance == pytest.approx((1 / 4 + 1 / 2) / 2)  # 0.375
    scores[4] = _s(-0.3)  # example 2 now picks "y": 1 of 2 right
    r = core.score_task(FixedScorer(scores), CharTok(), MC, examples, seed=0)
    assert r.accuracy == 0.5 and r.to_dict()["centered"] == pytest.approx((0.5 - 0.375) / (1 - 0.375))  # 0.2


def test_schema_by_hand():
    examples = [{"context_options": ["A said", "B said"], "continuation": "yes.", "gold": 1},
                {"context_options": ["C", "D", "E"], "continuation": "no", "gold": 0}]
    assert core.prompts(SCHEMA, examples, 0, 0) == [("A said", " yes."), ("B said", " yes.")]
    scores = [_s(-5.0, 2), _s(-1.0, 2), _s(-3.0), _s(-1.0), _s(-2.0)]  # first right, second wrong
    r = core.score_task(FixedScorer(scores), CharTok(), SCHEMA, examples, seed=0)
    chance = (1 / 2 + 1 / 3) / 2
    assert r.correct == 1 and r.chance == pytest.approx(chance)
    assert r.to_dict()["centered"] == pytest.approx((0.5 - chance) / (1 - chance))  # 0.4


def test_language_modelling_by_hand():
    examples = [{"context": "abc", "continuation": "d"}, {"context": "x", "continuation": "yz"},
                {"context": "p", "continuation": "q"}, {"context": "m", "continuation": "n"}]
    assert core.prompts(LM, examples, 0, 0) == [("abc", " d")]
    scores = [_s(-1, greedy=True), _s(-1, greedy=False), _s(-9, greedy=True), _s(-1, greedy=False)]
    r = core.score_task(FixedScorer(scores), CharTok(), LM, examples, seed=0)
    assert (r.correct, r.chance) == (2, 0.0) and r.to_dict()["centered"] == 0.5  # chance 0: centered = accuracy


def test_fewshot_sampling_is_seeded_and_excludes_the_example():
    picks = core.fewshot_indices(50, 7, 5, seed=3)
    assert picks == core.fewshot_indices(50, 7, 5, seed=3) and 7 not in picks and len(set(picks)) == 5
    assert picks != core.fewshot_indices(50, 7, 5, seed=4)


def test_wilson_and_aggregate():
    from scipy.optimize import brentq

    low, high = core.wilson(25, 100)  # the p where the score test is at its 95% bound: |0.25 - p| = z sqrt(p q / n)
    bound = lambda p: abs(0.25 - p) - core.Z95 * math.sqrt(p * (1 - p) / 100)  # noqa: E731
    assert low == pytest.approx(brentq(bound, 0.01, 0.25), abs=1e-9)
    assert high == pytest.approx(brentq(bound, 0.25, 0.99), abs=1e-9)
    a = core.TaskResult("a", "multiple_choice", 0, 100, 50, 0.25)
    b = core.TaskResult("b", "language_modeling", 0, 100, 10, 0.0)
    agg = core.aggregate([a, b])
    assert agg["core"] == pytest.approx(((0.5 - 0.25) / 0.75 + 0.1) / 2)
    assert agg["ci_low"] < agg["core"] < agg["ci_high"]


class RandomLogits(torch.nn.Module):
    """A model whose logits are independent standard normals (seeded), whatever the input."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg, self.w = cfg, torch.nn.Parameter(torch.zeros(1))
        self.g = torch.Generator().manual_seed(0)

    def forward(self, ids, depth=None, h0=None):
        return type("Out", (), {"logits": torch.randn(*ids.shape, self.cfg.vocab_size, generator=self.g)})


CORE_DIR = Path(__file__).resolve().parents[3] / "shared" / "data" / "eval" / "core"


@pytest.mark.skipif(not (CORE_DIR / core.TASKS_FILE).is_file(), reason="the CORE folder is not here")
@pytest.mark.parametrize("label", ["copa", "winograd", "bigbench_qa_wikidata"])  # one of each format
def test_random_logits_score_chance(label):
    from megaloop.config import ModelConfig
    from megaloop.eval.scoring import Scorer
    from tests.eval.eval_helpers import ByteTokenizer

    cfg = ModelConfig(vocab_size=260, d_model=32, n_heads=2, seq_len=24, mu_rec=3, mu_bwd=1, ve_gate_channels=8)
    spec = next(s for s in core.read_tasks(CORE_DIR)[0] if s.label == label)
    examples = core.read_examples(CORE_DIR, spec, 100)
    r = core.score_task(Scorer(RandomLogits(cfg), 1, batch_size=64), ByteTokenizer(), spec, examples, seed=0)
    low, high = r.interval()
    assert low <= r.chance <= high, (label, r.accuracy, r.chance)
    assert math.isfinite(r.to_dict()["centered"])
