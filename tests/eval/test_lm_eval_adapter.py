"""EleutherAI's harness runs the "megaloop" model on a local task file (no hub), and the log-likelihoods it records
equal a direct forward of the model on the same text (1e-5)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

lm_eval = pytest.importorskip("lm_eval")

DOCS = [{"query": "The sky is", "choices": ["blue", "green", "made of cheese"], "gold": 0},
        {"query": "Two plus two is", "choices": ["four", "five"], "gold": 0},
        {"query": "Cats say", "choices": ["meow", "woof", "moo"], "gold": 0}]


def _reference_loglikelihood(model, tok, context: str, continuation: str, depth: int, seed: int) -> float:
    """The model's forward on BOS-less context + continuation ids with the fixed h_0 drawn here, from the
    definitions (not through megaloop.eval.scoring)."""
    from megaloop.depth import initial_state

    stripped = context.rstrip(" ")
    cont = tok.encode(context[len(stripped):] + continuation)
    ids = tok.encode(stripped) + cont
    cfg = model.cfg
    h0 = initial_state(1, cfg.seq_len, cfg.d_model, seed, -2, [0], std=cfg.std)[:, :len(ids) - 1]
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]]), depth=depth, h0=h0).logits[0].double()
    lp = F.log_softmax(logits, -1)
    n = len(cont)
    return float(sum(lp[len(ids) - 1 - n + i, cont[i]] for i in range(n)))


def test_harness_loglikelihoods_equal_direct_scoring(tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager

    from megaloop.eval.lm_eval_adapter import MegaloopLM
    from tests.eval.eval_helpers import ByteTokenizer, small_model

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "task.yaml").write_text(
        "task: megaloop_local_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {data}\ntest_split: test\noutput_type: multiple_choice\ndoc_to_text: \"{{{{query}}}}\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{gold}}\"\nmetric_list:\n  - metric: acc\n")
    model, tok = small_model(seed=4), ByteTokenizer()
    lm = MegaloopLM(model=model, tokenizer_obj=tok, depth=2, seed=3, batch_size=2)
    out = lm_eval.simple_evaluate(model=lm, tasks=["megaloop_local_mc"], task_manager=TaskManager(
        include_path=str(tmp_path), include_defaults=False), log_samples=True, bootstrap_iters=0)
    samples = out["samples"]["megaloop_local_mc"]
    assert len(samples) == len(DOCS)
    checked = 0
    for s in samples:
        for args, resp in zip(s["arguments"], s["resps"]):
            context, continuation = args[0], args[1]
            want = _reference_loglikelihood(model, tok, context, continuation, depth=2, seed=3)
            assert abs(resp[0][0] - want) < 1e-5, (context, continuation, resp[0][0], want)
            checked += 1
    assert checked == sum(len(d["choices"]) for d in DOCS)
    assert 0.0 <= out["results"]["megaloop_local_mc"]["acc,none"] <= 1.0


def test_rolling_and_generate_until():
    from lm_eval.api.instance import Instance

    from megaloop.eval.generate import generate_uncached
    from megaloop.eval.lm_eval_adapter import MegaloopLM
    from tests.eval.eval_helpers import ByteTokenizer, small_model

    model, tok = small_model(seed=4), ByteTokenizer()
    lm = MegaloopLM(model=model, tokenizer_obj=tok, depth=3, seed=0)
    text = "a rolling text longer than one window of the model"  # 50 bytes > seq_len 24: three windows
    rolled = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])[0]
    ids = tok.encode(text)
    windows = [("", text[:24]), (text[23], text[24:48]), (text[47], text[48:])]
    assert sum(b == a for a, b in zip(ids, tok.encode("".join(w[1] for w in windows)))) == len(ids)
    parts = lm.loglikelihood([Instance("loglikelihood", {}, w, 0) for w in windows])
    assert abs(rolled - sum(p[0] for p in parts)) < 1e-6
    [generated] = lm.generate_until([Instance("generate_until", {}, ("abc", {"until": ["zzz"], "max_gen_toks": 5}),
                                              0)])
    want = generate_uncached(model, [tok.bos_id, *tok.encode("abc")], 3, 5, seed=0)
    assert generated == tok.decode([t for t in want if t != tok.eos_id]).split("zzz")[0]
