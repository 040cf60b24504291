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


def test_a_completed_run_without_checkpoints_takes_another_out_dir_or_is_deleted(saved_run, tiny_shards, tmp_path):
    out = tmp_path / "done"
    out.mkdir()
    for name in ("metrics.jsonl", "COMPLETED"):  # a finished run whose checkpoints were removed
        shutil.copy(saved_run / name, out / name)
    with pytest.raises(ResumeError) as refused:
        train(config(tiny_shards, out, 2))
    found = re.search(r"choose another (train\.out_dir), or delete '([^']+)' to start over", str(refused.value))
    assert found, refused.value
    assert train(config(tiny_shards, tmp_path / "another", 2)).steps_done == 2
    shutil.rmtree(found.group(2))  # the advice, followed: the same command then starts over
    assert train(config(tiny_shards, out, 2)).steps_done == 2


def corrupt_newest(root):
    from checkpoints import find_checkpoints

    step = find_checkpoints(root)[0]
    chunk = next(p for p in sorted((step / "model").rglob("*")) if p.is_file() and p.stat().st_size > 64)
    data = bytearray(chunk.read_bytes())
    data[32] ^= 0xFF
    chunk.write_bytes(bytes(data))
    return step


def verified(command: str, capsys) -> str:
    """Run the `python -m checkpoints verify PATH` a message shows; what it prints (it finds the checkpoint corrupt)."""
    from checkpoints.cli import main

    argv = command.split()
    assert argv[:3] == ["python", "-m", "checkpoints"], command
    capsys.readouterr()
    assert main(argv[3:]) == 1
    return capsys.readouterr().out


def test_a_run_whose_only_checkpoint_is_corrupt_starts_afresh_as_told(tiny_shards, tmp_path, capsys):
    assert train(config(tiny_shards, tmp_path, 4, "train.stop_at_step=2")).interrupted
    corrupt_newest(tmp_path / "checkpoints")
    with pytest.raises(ResumeError) as refused:
        train(config(tiny_shards, tmp_path, 4))
    message = str(refused.value)
    command = re.search(r"`(python -m checkpoints verify \S+)` shows what is wrong\); run the same command again",
                        message)
    assert command, message
    assert "checksum mismatch" in verified(command.group(1), capsys)
    summary = train(config(tiny_shards, tmp_path, 4))  # the same command, again
    assert summary.start_step == 0 and summary.steps_done == 4


def test_a_corrupt_checkpoint_to_resume_from_is_left_out_as_told(saved_run, tiny_shards, tmp_path, capsys):
    shutil.copytree(saved_run / "checkpoints", tmp_path / "other")
    corrupt_newest(tmp_path / "other")
    with pytest.raises(ResumeError) as refused:
        train(config(tiny_shards, tmp_path / "run", 2, f"checkpoint.resume={tmp_path / 'other'}"))
    message = str(refused.value)
    found = re.search(r"`(python -m checkpoints verify \S+)` shows what is wrong\); point checkpoint.resume at "
                      r"another checkpoint, or leave it null to start afresh$", message)
    assert found, message
    assert "checksum mismatch" in verified(found.group(1), capsys)
    assert (tmp_path / "other").exists()  # another run's checkpoints are never moved
    summary = train(config(tiny_shards, tmp_path / "run", 2, "checkpoint.resume=null"))
    assert summary.steps_done == 2 and not summary.resumed_from


def test_converted_official_weights_train_with_the_settings_convert_prints(tiny_shards, tmp_path, capsys):
    import torch

    from checkpoints.cli import main
    from megaloop.model import build_model
    from megaloop.model.convert import to_reference_state_dict

    cfg = config(tiny_shards, tmp_path / "run", 2)
    ref = to_reference_state_dict(build_model(cfg.model, seed=3).state_dict(), cfg.model)
    torch.save(ref, tmp_path / "official.pt")
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    capsys.readouterr()
    assert main(["convert", "--from-official", str(tmp_path / "official.pt"), "--config",
                 str(tmp_path / "config.json"), "--out", str(tmp_path / "converted")]) == 0
    printed = re.findall(r"--set (\S+)", capsys.readouterr().out)
    assert [s.split("=")[0] for s in printed] == ["checkpoint.resume", "checkpoint.load_optimizer"], printed
    with pytest.raises(ResumeError) as refused:  # only the first of them: weights without optimizer state
        train(config(tiny_shards, tmp_path / "run", 2, printed[0]))
    assert re.search(r"start from it with checkpoint\.resume=\.\.\. (checkpoint\.load_optimizer=false)",
                     str(refused.value)).group(1) == printed[1]
    summary = train(config(tiny_shards, tmp_path / "run", 2, *printed))  # both, as printed
    assert summary.steps_done == 2 and summary.resumed_from


def test_machine_refusals_before_training_propose_settings_that_pass(tiny_shards, tmp_path):
    import torch

    from megaloop.config import ConfigError
    from megaloop.train.cli import check_before_training

    if torch.cuda.is_available():
        pytest.skip("train.device=cuda is refused only where there is no CUDA device")
    with pytest.raises(ConfigError) as refused:
        check_before_training(config(tiny_shards, tmp_path / "run", 2, "train.device=cuda"))
    found = re.search(r"use (train\.device=cpu), or (auto)", str(refused.value))
    assert found, refused.value
    for setting in (found.group(1), f"train.device={found.group(2)}"):
        check_before_training(config(tiny_shards, tmp_path / "run", 2, setting))
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file, not a directory; choose another train.out_dir"):
        check_before_training(config(tiny_shards, tmp_path / "file", 2))
    check_before_training(config(tiny_shards, tmp_path / "another", 2))


def test_no_shards_and_data_parallel_in_one_process_are_fixed_as_proposed(tiny_shards, tmp_path):
    import torch

    from megaloop.config import ConfigError
    from megaloop.train.data import open_data
    from megaloop.train.runtime import make_runtime

    with pytest.raises(ConfigError) as refused:
        open_data(config(tiny_shards, tmp_path, 2, "data.shards=null"), 0, 1)
    assert re.search(r"set it to a directory written by `python -m data_prep shards` \(e\.g\. --set data\.shards=",
                     str(refused.value)), refused.value
    assert open_data(config(tiny_shards, tmp_path, 2), 0, 1) is not None  # tiny_shards: written by data_prep
    with pytest.raises(ConfigError) as refused:
        make_runtime(config(tiny_shards, tmp_path, 2, "parallel.dp=2"), torch.device("cpu"))
    fix = re.search(r"or set (parallel\.dp=null) to train in this one process", str(refused.value))
    assert fix, refused.value
    assert make_runtime(config(tiny_shards, tmp_path, 2, "parallel.dp=2", fix.group(1)), torch.device("cpu"))


def test_a_warmup_into_the_cool_down_passes_at_the_bound_named():
    from megaloop.optim.schedule import check_schedule

    with pytest.raises(ValueError) as refused:
        check_schedule(300, 290, 0.2)
    bound = int(re.search(r"set optim\.warmup_steps <= (\d+)", str(refused.value)).group(1))
    check_schedule(300, bound, 0.2)  # the advice, followed
    with pytest.raises(ValueError):
        check_schedule(300, bound + 1, 0.2)  # and it is the bound, not merely a smaller value


@pytest.mark.parametrize("target", ["step", "root"])
def test_a_resume_path_without_a_checkpoint_is_pointed_at_one_as_told(saved_run, tiny_shards, tmp_path, target):
    """checkpoint.resume naming a folder that holds no checkpoint: the refusal proposes a step_XXXXXXXX directory or
    a checkpoint root; either one, as told, resumes (the run continues from the saved step 2 to step 3)."""
    (tmp_path / "empty").mkdir()
    with pytest.raises(ResumeError) as refused:
        train(config(tiny_shards, tmp_path / "run", 3, f"checkpoint.resume={tmp_path / 'empty'}"))
    message = str(refused.value)
    assert message.endswith("point it at a step_XXXXXXXX directory or at a checkpoint root"), message
    root = saved_run / "checkpoints"
    path = next(root.glob("step_*")) if target == "step" else root
    summary = train(config(tiny_shards, tmp_path / "run", 3, f"checkpoint.resume={path}"))
    assert summary.resumed_from and summary.start_step == 2 and summary.steps_done == 3
