"""Advice followed: where a training error proposes a setting, the proposal is run and gets further; where a
proposal could not work, the error no longer makes it."""
from __future__ import annotations

import json
import re
import shutil

import pytest

from megaloop.config import load_config
from megaloop.train.checkpointing import ResumeError
from megaloop.train.cli import format_summary, run_training
from megaloop.train.loop import train
from tests.train.conftest import TINY, fast_overrides

DIVERGING = ["train.precision=fp64", "optim.matrix_lr=1e200", "optim.adam_lr=1e200", "train.max_consecutive_skips=3"]


def config(shards, out, steps: int, *extra: str):
    return load_config(TINY, fast_overrides(shards, out, steps) + ["train.val_depths=[2]", "data.val_batches=1",
                                                                   *extra])


@pytest.fixture(scope="module")
def saved_run(tiny_shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("saved")
    train(config(tiny_shards, out, 2))
    return out


def test_another_model_with_the_same_shapes_is_told_to_start_from_the_weights(saved_run, tiny_shards, tmp_path):
    with pytest.raises(ResumeError) as refused:
        train(config(tiny_shards, saved_run, 4, "model.mu_rec=6"))
    advice = re.search(r"another train.out_dir with (checkpoint.resume=\S+) (checkpoint.load_optimizer=false)",
                       str(refused.value))
    assert advice, refused.value
    summary = train(config(tiny_shards, tmp_path, 4, "model.mu_rec=6", *advice.groups()))  # the advice, followed
    assert summary.steps_done == 4 and summary.resumed_from


def test_another_model_with_other_shapes_is_not_told_to_load_its_weights(saved_run, tiny_shards, tmp_path):
    with pytest.raises(ResumeError) as refused:
        train(config(tiny_shards, saved_run, 4, "model.d_model=96"))
    message = str(refused.value)
    assert "model.d_model: saved 64, now 96" in message and "load_optimizer=false" not in message, message
    with pytest.raises(ResumeError, match="has shape"):  # what that advice led to: it cannot work
        train(config(tiny_shards, tmp_path, 4, "model.d_model=96", f"checkpoint.resume={saved_run / 'checkpoints'}",
                     "checkpoint.load_optimizer=false"))


def test_shards_without_a_val_split_train_with_validation_reported_as_na(tiny_shards, tmp_path, capfd):
    from data_prep.prepare import ShardOptions, prepare_shards

    root = tiny_shards.parent
    prepare_shards(root / "corpus", root / "tok", tmp_path / "shards",
                   ShardOptions(seq_len=32, val_fraction=0.0, shard_size=256, progress=False))
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    del manifest["splits"]["val"]  # a manifest with the train split only (made elsewhere, or by hand)
    (tmp_path / "shards" / "manifest.json").write_text(json.dumps(manifest))
    cfg = config(tmp_path / "shards", tmp_path / "run", 4, "train.val_every=2")
    summary = train(cfg)
    assert "reported as n/a" in capfd.readouterr().err
    assert summary.steps_done == 4 and all(v["tokens"] == 0 for v in summary.val.values())
    assert "n/a" in format_summary(cfg, summary)


def diverged(shards, out, capfd) -> str:
    assert run_training(config(shards, out, 6, *DIVERGING)) == 1
    return capfd.readouterr().err.strip().splitlines()[-1]


def test_diverged_fp64_run_gets_advice_that_works(tiny_shards, tmp_path, capfd):
    message = diverged(tiny_shards, tmp_path / "a", capfd)
    assert "stopped at step 3" in message and "train.precision" not in message and "reduced precision" not in message
    assert "lower optim.matrix_lr / optim.adam_lr" in message and "raise train.max_consecutive_skips" in message
    # lower the learning rates, same out_dir (no checkpoint was committed: it starts afresh): it trains
    summary = train(config(tiny_shards, tmp_path / "a", 6, *DIVERGING[:1]))
    assert summary.steps_done == 6 and summary.skipped == 0
    # raise train.max_consecutive_skips: the run gets past the step it stopped at
    diverged(tiny_shards, tmp_path / "b", capfd)
    summary = train(config(tiny_shards, tmp_path / "b", 6, *DIVERGING[:-1], "train.max_consecutive_skips=10"))
    assert summary.steps_done == 6


def shards_missing_every_other_train_file(tiny_shards, root):
    shards = root / "shards"
    shutil.copytree(tiny_shards, shards)
    for tar in sorted(shards.glob("train-*.tar"))[::2]:
        tar.unlink()
    return shards


def test_unreadable_shard_fails_before_the_run_folder_exists_and_skip_gets_further(tiny_shards, tmp_path, capfd):
    shards = shards_missing_every_other_train_file(tiny_shards, tmp_path)
    cfg = config(shards, tmp_path / "run", 4, "data.verify=none")  # found when the first batch is read
    assert run_training(cfg) == 2
    message = capfd.readouterr().err.strip().splitlines()[-1]
    assert "data.on_corrupt=skip" in message, message
    assert not (tmp_path / "run").exists()  # no folder, no empty metrics.jsonl, no config.json
    summary = train(config(shards, tmp_path / "run", 4, "data.verify=none", "data.on_corrupt=skip"))
    assert summary.steps_done == 4
