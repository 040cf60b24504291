"""eval reads a committed checkpoint into the model that saved it, scores validation rows as the trainer does, and
refuses bad input with one line and exit code 2."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from megaloop.__main__ import main
from megaloop.eval.checkpoint import load_model
from megaloop.eval.depth_eval import Rows, evaluate_depths, row_losses

from tests.eval.eval_helpers import save_checkpoint, small_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = small_model()
    root = tmp_path_factory.mktemp("ckpt")
    save_checkpoint(model, root)
    return model, root


def test_loaded_model_equals_saved_one(saved):
    model, root = saved
    loaded = load_model(root)
    assert loaded.step == 5
    for (name, a), (_, b) in zip(model.named_parameters(), loaded.model.named_parameters()):
        assert torch.equal(a, b), name
    assert torch.equal(loaded.model.rope_cos, model.rope_cos)


def test_eval_loss_equals_trainer_validation(saved):
    """Same rows, same T, same h_0 keys: megaloop.train.evaluate.validation_losses within 1e-6."""
    from megaloop.train.evaluate import validation_losses
    from megaloop.train.runtime import SingleProcessRuntime

    model, root = saved
    model = load_model(root).model
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, 260, (10, model.cfg.seq_len + 1), generator=g)
    batches = [{"tokens": tokens[i:i + 4], "sample_index": torch.arange(i, min(i + 4, 10)),
                "valid": torch.ones(min(4, 10 - i), dtype=torch.bool)} for i in (0, 4, 8)]
    trainer = validation_losses(model, batches, [1, 3, 5], seed=7, precision="fp32", device=torch.device("cpu"),
                                runtime=SingleProcessRuntime(torch.device("cpu")))
    rows = Rows(tokens, torch.ones(10, model.cfg.seq_len, dtype=torch.bool), torch.arange(10))
    ours = evaluate_depths(model, rows, [1, 3, 5], seed=7, batch_size=3)  # another batching on purpose
    for t in (1, 3, 5):
        assert abs(ours[t]["loss"] - trainer[t]["val_loss"]) < 1e-6
        assert ours[t]["ci_low"] < ours[t]["loss"] < ours[t]["ci_high"]
    assert ours[1]["loss"] != ours[5]["loss"]  # the depth is used


def test_padding_positions_carry_no_loss(saved):
    model = saved[0]
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(3, 260, (2, model.cfg.seq_len + 1), generator=g)
    labelled = torch.ones(2, model.cfg.seq_len, dtype=torch.bool)
    labelled[1, 10:] = False
    sums, counts = row_losses(model, Rows(tokens, labelled, torch.arange(2)), 2, 0)
    changed = tokens.clone()
    changed[1, 12:] = 5  # labels and inputs after position 10 change; causal, unlabelled: no effect
    sums2, _ = row_losses(model, Rows(changed, labelled, torch.arange(2)), 2, 0)
    assert counts.tolist() == [model.cfg.seq_len, 10]
    assert np.allclose(sums, sums2, rtol=0, atol=1e-9)


def _one_line_exit_2(capsys, argv, needle):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and needle in err, err


def test_bad_input_one_line_exit_2(saved, tmp_path, capsys):
    _, root = saved
    _one_line_exit_2(capsys, ["eval", str(tmp_path / "nope")], "no such file")
    (tmp_path / "empty").mkdir()
    _one_line_exit_2(capsys, ["eval", str(tmp_path / "empty")], "no committed checkpoint")
    _one_line_exit_2(capsys, ["eval", str(root), "--depths", "0,2"], "cannot run T=0")
    _one_line_exit_2(capsys, ["eval", str(root), "--depths", "two"], "integers")
    _one_line_exit_2(capsys, ["generate", str(root), "--prompt", "x", "--depth", "0"], "cannot run")
    core = tmp_path / "core"
    core.mkdir()
    (core / "tasks_v0.3.yaml").write_text("icl_tasks:\n- label: copa\n  dataset_uri: eval/local_data/copa.jsonl\n"
                                          "  num_fewshot: [0]\n  icl_task_type: multiple_choice\n")
    _one_line_exit_2(capsys, ["eval", str(root), "--tasks", "cpoa", "--core-dir", str(core)], "unknown task 'cpoa'")
    other = tmp_path / "other.yaml"
    other.write_text("model:\n  arch: parcae\n  vocab_size: 260\n  d_model: 64\n  n_heads: 2\n  n_prelude: 1\n"
                     "  n_core: 2\n  n_coda: 1\n  seq_len: 24\n  mu_rec: 3\n  mu_bwd: 1\n  ve_gate_channels: 8\n")
    _one_line_exit_2(capsys, ["eval", str(root), "--config", str(other)], "another architecture")


def test_gpt_baseline_runs_only_t1(tmp_path, capsys):
    model = small_model(injection="none", mu_rec=1, mu_bwd=1, arch="gpt", prelude_norm=False, use_C=False)
    save_checkpoint(model, tmp_path)
    _one_line_exit_2(capsys, ["eval", str(tmp_path), "--depths", "2"], "T=1 only")


def test_generate_says_why_it_stopped_and_when_the_prompt_is_empty(saved, monkeypatch, capsys):
    """40 tokens asked where the context holds 13 more: the 13 come with the reason; an empty prompt is named as
    generation from <|bos|> alone."""
    import json

    import megaloop.eval.cli as eval_cli
    from tests.eval.eval_helpers import ByteTokenizer

    _, root = saved
    monkeypatch.setattr(eval_cli, "load_tokenizer_for", lambda *a: ByteTokenizer())
    assert main(["generate", str(root), "--prompt", "abcdefghij", "--max-new-tokens", "40", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == 24 - 11, out  # seq_len 24, the prompt 10 bytes + <|bos|>
    assert out["stopped"].startswith("stopped at the context limit (40 asked") and "seq_len 24" in out["stopped"]
    assert main(["generate", str(root), "--prompt", "", "--max-new-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert "the prompt is empty: generating from <|bos|> alone" in err and "3 tokens at T=3, the 3 asked for" in err
