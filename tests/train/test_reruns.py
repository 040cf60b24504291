"""Re-running a run's command: with nothing to do it changes no file of the run; after an attempt that committed no
checkpoint it starts afresh and keeps the old metrics aside; the summary's tokens and steps span the same steps; a
larger train.steps extends the run as train.extend says."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import megaloop.train.loop as loop
from checkpoints.load import CheckpointReader, find_checkpoints
from megaloop.config import load_config
from megaloop.train.checkpointing import ResumeError
from megaloop.train.cli import format_summary
from megaloop.train.loop import train
from megaloop.train.metrics import read_metrics
from tests.train.conftest import TINY, fast_overrides

TOKENS_PER_STEP = 8 * 32  # fast_overrides: 8 rows of 32 tokens per step


def config(shards, out: Path, steps: int, *extra: str):
    return load_config(TINY, fast_overrides(shards, out, steps) + ["train.val_depths=[2]", "train.val_every=100",
                                                                   *extra])


def files_of(out: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under the run folder: its bytes and modification time (ns)."""
    return {str(p.relative_to(out)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(out.rglob("*"))
            if p.is_file()}


@pytest.fixture(scope="module")
def finished(tiny_shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("finished")
    return out, train(config(tiny_shards, out, 4))


@pytest.mark.parametrize("steps", [2, 4])
def test_rerun_with_nothing_to_do_changes_no_file(finished, tiny_shards, capfd, steps):
    out, first = finished
    before = files_of(out)
    again = train(config(tiny_shards, out, steps))
    assert "nothing to do" in capfd.readouterr().err
    assert files_of(out) == before  # summary.json, config.json, metrics.jsonl, markers, checkpoints: untouched
    assert again.steps_done == 4 and again.tokens == 4 * TOKENS_PER_STEP and not again.losses
    assert again.val == first.val and first.val  # the run's final validation, as its summary.json recorded it


def interrupted_at(step: int, monkeypatch) -> None:
    """Make the training step raise at `step` (a process killed there: no checkpoint, metrics already written)."""
    real = loop.train_step

    def train_step(model, optimizer, batch, depth_sample, at, *args, **kwargs):
        if at == step:
            raise KeyboardInterrupt
        return real(model, optimizer, batch, depth_sample, at, *args, **kwargs)

    monkeypatch.setattr(loop, "train_step", train_step)


def test_attempt_without_checkpoint_is_restarted_by_the_same_command(tiny_shards, tmp_path, monkeypatch, capfd):
    with monkeypatch.context() as patch:
        interrupted_at(2, patch)
        with pytest.raises(KeyboardInterrupt):
            train(config(tiny_shards, tmp_path, 4))
    assert not (tmp_path / "checkpoints").exists() and (tmp_path / "metrics.jsonl").exists()
    capfd.readouterr()
    summary = train(config(tiny_shards, tmp_path, 4))
    err = capfd.readouterr().err
    assert "starting the run afresh" in err and "metrics.1.jsonl" in err
    assert summary.start_step == 0 and summary.steps_done == 4
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.1.jsonl") if r["kind"] == "train"] == [0, 1]
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "train"] == [0, 1, 2, 3]
    assert not [r for r in records if r["kind"] == "resume"]
    assert (tmp_path / "tb.1").is_dir() and (tmp_path / "tb").is_dir()


def test_completed_run_without_checkpoints_is_still_refused(finished, tiny_shards, tmp_path):
    """A finished run whose checkpoints were deleted keeps its record: a fresh start there is refused."""
    out, _ = finished
    for name in ("metrics.jsonl", "COMPLETED"):
        (tmp_path / name).write_bytes((out / name).read_bytes())
    with pytest.raises(ResumeError, match="completed run"):
        train(config(tiny_shards, tmp_path, 4))


def test_summary_tokens_and_steps_span_the_whole_run(tiny_shards, tmp_path):
    first = train(config(tiny_shards, tmp_path, 4, "train.stop_at_step=3"))
    assert first.interrupted and first.tokens == 3 * TOKENS_PER_STEP
    second = train(config(tiny_shards, tmp_path, 4))
    assert second.start_step == 3 and second.steps_done == 4
    assert second.tokens == 4 * TOKENS_PER_STEP and second.job_tokens == TOKENS_PER_STEP
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["steps_done"] == 4 and saved["tokens"] == 4 * TOKENS_PER_STEP
    assert saved["tokens_per_s"] == pytest.approx(TOKENS_PER_STEP / saved["train_time_s"])
    table = format_summary(config(tiny_shards, tmp_path, 4), second)
    assert "4 steps" in table and f"{4 * TOKENS_PER_STEP:,} tokens" in table
    assert f"this job: 1 steps from step 3, {TOKENS_PER_STEP:,} tokens" in table


def lrs(out: Path) -> dict[int, float]:
    """step -> the logged (Muon base) learning rate; the last record of a step wins."""
    return {r["step"]: r["lr"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"}


def extended(finished, tiny_shards, tmp_path, steps: int, *extra: str) -> dict[int, float]:
    shutil.copytree(finished[0], tmp_path, dirs_exist_ok=True)
    summary = train(config(tiny_shards, tmp_path, steps, *extra))
    assert summary.start_step == 4 and summary.steps_done == steps
    return lrs(tmp_path)


def test_extending_a_finished_run_keeps_its_decayed_rate(finished, tiny_shards, tmp_path, capfd):
    lr = extended(finished, tiny_shards, tmp_path, 6)  # the default: train.extend=continue
    assert lr[3] == pytest.approx(8e-3 / 2)  # the 4-step run's last step: half-way down its 2-step cool-down
    assert lr[4] == lr[5] == lr[3]  # not back up to 8e-3 * 2/3, where a 6-step schedule is at step 4
    assert "train.extend=continue keeps it" in capfd.readouterr().err
    assert CheckpointReader(find_checkpoints(tmp_path / "checkpoints")[0]).metadata["schedule_steps"] == 4
    summary = train(config(tiny_shards, tmp_path, 7))  # extended again: still the 4-step schedule's last rate
    assert summary.start_step == 6 and lrs(tmp_path)[6] == lr[3]


def test_extending_with_rewarm_spans_the_schedule_over_the_new_steps(finished, tiny_shards, tmp_path):
    lr = extended(finished, tiny_shards, tmp_path, 6, "train.extend=rewarm")
    assert lr[4] == pytest.approx(8e-3 * 2 / 3) and lr[5] == pytest.approx(8e-3 / 3)


def test_checkpoints_without_a_recorded_horizon_use_their_train_steps(tiny_shards, tmp_path):
    """Checkpoints saved before the horizon was recorded: their schedule spanned the saving job's train.steps."""
    from megaloop.train.rerun import schedule_horizon

    notes = []
    old_meta = {"config": {"train": {"steps": 4}}}
    assert schedule_horizon(old_meta, config(tiny_shards, tmp_path, 6), 4, notes.append) == 4 and notes
    assert schedule_horizon(old_meta, config(tiny_shards, tmp_path, 4), 2, notes.append) == 4
    assert schedule_horizon(old_meta, config(tiny_shards, tmp_path, 6, "train.extend=rewarm"), 4, print) == 6


def test_a_rerun_with_nothing_to_do_prints_that_line_only(finished, tiny_shards, capfd):
    """No closing table of nan and blanks for a job that trained nothing: the one line says it all."""
    from megaloop.train.cli import run_training

    out, _ = finished
    assert run_training(config(tiny_shards, out, 4)) == 0
    captured = capfd.readouterr()
    assert captured.out.strip() == "" and "nan" not in captured.err, captured.out
    assert captured.err.strip().splitlines()[-1] == (
        "megaloop: nothing to do: the run is at step 4 of train.steps=4 (raise train.steps to train further); no "
        "file of the run was changed")


def test_a_second_extension_names_only_the_steps_it_runs(tiny_shards, tmp_path):
    """A schedule of 100 steps, extended to 150 and now to 160: this job runs 150..159 at step 99's rate (100..149
    already did), not '100..159'."""
    from megaloop.train.rerun import schedule_horizon

    notes = []
    assert schedule_horizon({"schedule_steps": 100}, config(tiny_shards, tmp_path, 160), 150, notes.append) == 100
    assert "steps 150..159 run at the rate of step 99, as steps 100..149 did" in notes[0], notes
    notes.clear()
    assert schedule_horizon({"schedule_steps": 100}, config(tiny_shards, tmp_path, 150), 100, notes.append) == 100
    assert "steps 100..149 run at the rate of step 99 (" in notes[0], notes
