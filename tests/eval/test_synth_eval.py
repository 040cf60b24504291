"""`megaloop eval --tasks synth`: per-hops answer accuracy and loss equal a row-by-row forward done here, an oracle
scores 1.0, a uniform model log V (and a model uniform over the letters about 1/8 with a binomial-width
interval), the bootstrap interval holds its point value, and bad input is one line with exit code 2."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from data_prep.synth import SynthOptions, write_synth
from megaloop.__main__ import main
from megaloop.eval.errors import EvalInputError
from megaloop.eval.scoring import EVAL_NOISE_STEP, Scorer
from megaloop.eval.synth import evaluate_synth, read_synth

from tests.eval.eval_helpers import save_checkpoint, small_model

VOCAB, LETTERS, FIRST_LETTER = 22, 8, 7  # khop: 4 specials, > | =, the letters a..h, hop counts 1..7
KEYS = {"acc", "acc_lo", "acc_hi", "loss", "loss_lo", "loss_hi", "n"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """khop at seq_len 128: 25 queries a row, 200 held-out rows (5000 answers over hops 1..4)."""
    out = tmp_path_factory.mktemp("synth") / "khop"
    write_synth(out, SynthOptions("khop", (1, 4), rows=8, val_rows=200, seed=4, seq_len=128))
    return out


@pytest.fixture(scope="module")
def model():
    return small_model(vocab_size=VOCAB, seq_len=128)


def _reference(model, data, depth: int, seed: int, rows: int) -> dict:
    """{hops: (accuracy, mean loss)} from one forward per row, h_0 drawn here, answers read from the rows."""
    from megaloop.depth import initial_state

    synth, cfg = read_synth(data, rows), model.cfg
    h0 = initial_state(1, cfg.seq_len, cfg.d_model, seed, EVAL_NOISE_STEP, [0], std=cfg.std, device="cpu")
    found: dict[int, list] = {}
    for r in range(rows):
        tokens = synth.tokens[r]
        with torch.no_grad():
            logits = model(tokens[None, :-1], depth=depth, h0=h0[:, :len(tokens) - 1]).logits[0].float()
        for row, position, hops in synth.queries[synth.queries[:, 0] == r]:
            lp = F.log_softmax(logits[position - 1], -1)
            found.setdefault(int(hops), []).append((int(lp.argmax()) == int(tokens[position]),
                                                    -float(lp[tokens[position]])))
    return {k: (np.mean([c for c, _ in v]), np.mean([x for _, x in v])) for k, v in found.items()}


def test_table_equals_a_row_by_row_forward(model, data):
    """Batches of 4 over 11 rows (a partial last batch), T = 1 and 3, against one-row forwards."""
    result = evaluate_synth(model, data, [1, 3], seed=5, batch_size=4, limit=11)
    assert (result["task"], result["rows"], result["queries"]) == ("khop", 11, 11 * 25)
    for depth in (1, 3):
        reference = _reference(model, data, depth, 5, 11)
        table = result["by_depth"][depth]
        assert sorted(table) == [1, 2, 3, 4] and sum(e["n"] for e in table.values()) == 11 * 25
        for hops, (acc, loss) in reference.items():
            entry = table[hops]
            assert set(entry) == KEYS
            assert entry["acc"] == pytest.approx(acc, abs=1e-12) and entry["loss"] == pytest.approx(loss, abs=1e-5)
            assert entry["acc_lo"] <= entry["acc"] <= entry["acc_hi"]
            assert entry["loss_lo"] <= entry["loss"] <= entry["loss_hi"]
    assert result["by_depth"][1] != result["by_depth"][3]  # the depth reaches the model


def _patch_logits(monkeypatch, data, make):
    """Scorer.logits -> make(full rows [B, seq_len + 1]) for the rows the scorer is given."""
    rows = {tuple(r[:-1].tolist()): r for r in read_synth(data).tokens}
    monkeypatch.setattr(Scorer, "logits", lambda self, ids: make(torch.stack([rows[tuple(i.tolist())] for i in ids])))


def test_oracle_scores_one(model, data, monkeypatch):
    _patch_logits(monkeypatch, data, lambda full: 50.0 * F.one_hot(full[:, 1:], VOCAB).float())
    table = evaluate_synth(model, data, [2], seed=0)["by_depth"][2]
    for entry in table.values():
        assert entry["acc"] == entry["acc_lo"] == entry["acc_hi"] == 1.0
        assert 0 <= entry["loss_lo"] <= entry["loss"] <= entry["loss_hi"] < 1e-12  # log(1 + 21 e^-50)


def test_uniform_model_loss_is_log_v(model, data, monkeypatch):
    _patch_logits(monkeypatch, data, lambda full: torch.zeros(len(full), full.shape[1] - 1, VOCAB))
    table = evaluate_synth(model, data, [1], seed=0)["by_depth"][1]
    for entry in table.values():
        assert entry["loss"] == pytest.approx(math.log(VOCAB), abs=1e-6)
        assert entry["loss_lo"] == pytest.approx(math.log(VOCAB), abs=1e-6)
        assert entry["acc"] == 0.0  # the argmax of ties is id 0, <|bos|>, never an answer


def test_model_uniform_over_symbols_is_at_chance(model, data, monkeypatch):
    """Equal logits on the 8 letters (ties broken by noise of 1e-4): loss log 8, accuracy 1/8 within 4 binomial
    standard errors, and an interval about as wide as the normal approximation's 2 x 1.96 x se."""
    g = torch.Generator().manual_seed(0)

    def symbols_only(full):
        logits = torch.full((len(full), full.shape[1] - 1, VOCAB), -1e9)
        logits[..., FIRST_LETTER:FIRST_LETTER + LETTERS] = 1e-4 * torch.rand(len(full), full.shape[1] - 1, LETTERS,
                                                                              generator=g)
        return logits

    _patch_logits(monkeypatch, data, symbols_only)
    table = evaluate_synth(model, data, [1], seed=0)["by_depth"][1]
    p = 1 / LETTERS
    for entry in table.values():
        se = math.sqrt(p * (1 - p) / entry["n"])
        assert entry["n"] > 800 and abs(entry["acc"] - p) < 4 * se
        assert entry["loss"] == pytest.approx(math.log(LETTERS), abs=1e-3)
        assert entry["acc_lo"] <= entry["acc"] <= entry["acc_hi"]
        assert entry["acc_hi"] - entry["acc_lo"] == pytest.approx(2 * 1.96 * se, rel=0.3)


def test_cli_json_and_report(model, data, tmp_path, capsys):
    root = tmp_path / "ckpt"
    save_checkpoint(model, root)
    argv = ["eval", str(root), "--tasks", "synth", "--shards", str(data), "--depths", "1,2", "--val-rows", "10"]
    assert main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)["synth"]
    expected = evaluate_synth(model, data, [1, 2], seed=0, limit=10)  # the run's seed is 0
    assert out["task"] == "khop" and out["rows"] == 10 and sorted(out["by_depth"]) == ["1", "2"]
    for t in (1, 2):
        for hops, entry in expected["by_depth"][t].items():
            assert out["by_depth"][str(t)][str(hops)] == pytest.approx(entry, abs=1e-9)
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "synth task khop (10 val rows, 250 answers" in text and text.count("\n    2  ") >= 4


def test_bad_input(model, data, tmp_path, capsys):
    root = tmp_path / "ckpt"
    save_checkpoint(model, root)
    plain = tmp_path / "plain"
    plain.mkdir()
    manifest = json.loads((data / "manifest.json").read_text())
    del manifest["synth"]
    (plain / "manifest.json").write_text(json.dumps(manifest))
    for shards, needle in ((plain, "is not a synthetic dataset"), (tmp_path / "none", "no manifest.json")):
        assert main(["eval", str(root), "--tasks", "synth", "--shards", str(shards)]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and err.startswith("megaloop eval: --tasks synth:") and needle in err, err
    with pytest.raises(EvalInputError, match="make the dataset with --seq-len 64"):
        evaluate_synth(small_model(vocab_size=VOCAB, seq_len=64), data, [1])
    with pytest.raises(EvalInputError, match="uses 22 token ids, the model knows 16"):
        evaluate_synth(small_model(vocab_size=16, seq_len=128), data, [1])
