"""Checkpoints in one process, through megaloop's trainer: a run stopped at step 20 and re-run to 40 equals the
40-step run bit for bit (fp32, same thread count: per-sequence depths, gradient accumulation, Muon + AdamW), and the
saved arrays are the parameters it trained; weights-only starts, refusals of a used out_dir and of another model;
a corrupt newest checkpoint falls back to the previous one."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from checkpoints.load import CheckpointReader, find_checkpoints
from megaloop.config import load_config
from megaloop.train.checkpointing import ResumeError, RunCheckpoints
from megaloop.train.data import open_data
from megaloop.train.loop import build_model_and_optimizer, train
from megaloop.train.metrics import read_metrics
from megaloop.train.runtime import SingleProcessRuntime
from megaloop.train.stopping import deadline_from

TINY = Path(__file__).resolve().parents[2] / "configs" / "parcae-tiny.yaml"


class KeepingRuntime(SingleProcessRuntime):
    """The single-process runtime, keeping the model so that a test can read its final parameters."""

    def prepare_model(self, model):
        self.model = model
        return model


def overrides(shards, out_dir, steps: int, *extra: str) -> list[str]:
    """parcae-tiny on 32-token rows: 12 rows per step in micro-batches of 2 (6 per step: gradient accumulation),
    per-sequence depths (poisson-truncated-full, mu_rec 4), Muon + AdamW, fp32."""
    return [f"data.shards={shards}", f"train.out_dir={out_dir}", f"train.steps={steps}", "model.vocab_size=512",
            "model.seq_len=32", "data.micro_batch_size=2", "data.global_batch_size=12", "data.val_batches=1",
            "train.val_every=1000", "train.progress=false", "train.precision=fp32", "train.val_depths=[2]",
            *extra]


def run(shards, out_dir, steps: int, *extra: str):
    runtime = KeepingRuntime(torch.device("cpu"))
    summary = train(load_config(str(TINY), overrides(shards, out_dir, steps, *extra)), runtime=runtime)
    return summary, {n: p.detach().clone() for n, p in runtime.model.named_parameters()}


@pytest.fixture(scope="module")
def straight(tiny_shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    summary, params = run(tiny_shards, out, 40)
    return out, summary, params


def test_stop_and_rerun_equals_straight_run_bitwise(straight, tiny_shards, tmp_path):
    out_a, summary_a, params_a = straight
    first, _ = run(tiny_shards, tmp_path, 40, "train.stop_at_step=20")
    assert first.interrupted and first.steps_done == 20 and not first.val  # no validation on the way out
    second, params_b = run(tiny_shards, tmp_path, 40)
    assert second.start_step == 20 and second.steps_done == 40
    losses_b = first.losses + second.losses
    print(f"40 straight: losses {summary_a.losses[0]:.6f} .. {summary_a.losses[-1]:.6f}; 20 + 20: "
          f"{losses_b[0]:.6f} .. {losses_b[-1]:.6f}; identical losses {losses_b == summary_a.losses}, identical "
          f"parameters {all(torch.equal(params_b[n], p) for n, p in params_a.items())}")
    assert losses_b == summary_a.losses
    assert all(torch.equal(params_b[n], p) for n, p in params_a.items())
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(40))
    assert [r["step"] for r in records if r["kind"] == "resume"] == [20]


def test_saved_arrays_are_the_trained_state(straight):
    out, summary, params = straight
    found = find_checkpoints(out / "checkpoints")
    reader = CheckpointReader(found[0])
    assert reader.step == 40 and reader.metadata["loader"]["step"] == 40
    for name, p in params.items():
        assert torch.equal(reader.read(f"model/{name}"), p), name
    names = set(reader.arrays)
    assert any(n.startswith("optim/muon/momentum_buffer/") for n in names)
    assert any(n.startswith("optim/muon/second_moment/") for n in names)
    assert any(n.startswith("optim/adamw/exp_avg_sq/") for n in names)
    moment = next(n for n in names if n.startswith("optim/adamw/exp_avg/"))
    assert reader.read(moment).abs().sum() > 0  # real moments, not a fresh state
    assert reader.metadata["optimizer"]["iteration"] == 40


def test_rerun_of_a_finished_run_does_nothing(straight, tiny_shards, capfd):
    out, summary, params = straight
    again, params_again = run(tiny_shards, out, 40)
    assert again.start_step == again.steps_done == 40 and not again.losses
    assert "nothing to do" in capfd.readouterr().err
    assert all(torch.equal(params_again[n], p) for n, p in params.items())


def test_weights_only_start_from_another_run(straight, tiny_shards, tmp_path):
    out, _, params = straight
    cfg = load_config(str(TINY), overrides(tiny_shards, tmp_path, 1, f"checkpoint.resume={out / 'checkpoints'}",
                                           "checkpoint.load_optimizer=false"))
    runtime = KeepingRuntime(torch.device("cpu"))
    data = open_data(cfg, 0, 1)
    model, optimizer = build_model_and_optimizer(cfg, runtime, torch.device("cpu"))
    start = RunCheckpoints(cfg, runtime).restore(model, optimizer, data)
    data.close()
    assert start == 0 and optimizer.iteration == 0 and data.state_dict()["step"] == 0
    assert not optimizer.muon.state and not optimizer.adamw.state  # a fresh optimizer
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())
    summary, _ = run(tiny_shards, tmp_path, 1, f"checkpoint.resume={out / 'checkpoints'}",
                     "checkpoint.load_optimizer=false")
    assert summary.start_step == 0 and summary.steps_done == 1


def test_fresh_run_in_a_used_out_dir_is_refused(tiny_shards, tmp_path):
    run(tiny_shards, tmp_path, 2)
    shutil.rmtree(tmp_path / "checkpoints")
    with pytest.raises(ResumeError, match="already holds a completed run"):
        run(tiny_shards, tmp_path, 4)


def test_resume_with_another_model_is_refused(straight, tiny_shards, tmp_path):
    out, _, _ = straight
    shutil.copytree(out / "checkpoints", tmp_path / "checkpoints")
    with pytest.raises(ResumeError, match="model.mu_rec"):
        run(tiny_shards, tmp_path, 50, "model.mu_rec=6")


def flip_a_byte(step_dir: Path) -> str:
    """Flip one byte of the largest chunk file of a model array; returns the array's name."""
    chunks = [p for p in (step_dir / "model").rglob("*") if p.is_file() and p.name != "zarr.json"]
    target = max(chunks, key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x40
    target.write_bytes(bytes(data))
    return target.relative_to(step_dir / "model").parts[0]


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tiny_shards, tmp_path, capfd):
    run(tiny_shards, tmp_path, 20, "checkpoint.every=10")
    found = find_checkpoints(tmp_path / "checkpoints")
    assert [CheckpointReader(p).step for p in found] == [20, 10]
    array = flip_a_byte(found[0])
    summary, _ = run(tiny_shards, tmp_path, 22)
    err = capfd.readouterr().err
    assert summary.start_step == 10, err
    line = next(x for x in err.splitlines() if "is unusable" in x)
    assert array in line and line.startswith("megaloop: checkpoint step_00000020 is unusable (")
    assert line.endswith("set aside as step_00000020.corrupt; resuming from step_00000010 instead"), line
    assert str(found[0]) not in line  # the path once, as a name, not repeated in every clause
    # the corrupt one is set aside (not tried again, not counted by retention); the new one is the latest
    assert (tmp_path / "checkpoints" / "step_00000020.corrupt").is_dir()
    assert [CheckpointReader(p).step for p in find_checkpoints(tmp_path / "checkpoints")] == [22, 10]


def test_the_only_checkpoint_corrupt_gives_advice_that_works_when_followed(tiny_shards, tmp_path, capfd):
    """A flipped byte in a finished run's only checkpoint: one line says what was found and that there is nothing
    to fall back to; `latest` is gone with it (never naming a missing folder); the advice, run the same command
    again, is followed literally and trains the run afresh, keeping the old metrics; `checkpoints verify --all`
    then passes on the new checkpoint."""
    from megaloop.train.checkpointing import ResumeError

    run(tiny_shards, tmp_path, 4)
    root = tmp_path / "checkpoints"
    only = find_checkpoints(root)[0]
    flip_a_byte(only)
    with pytest.raises(ResumeError) as failure:
        run(tiny_shards, tmp_path, 4)
    err = capfd.readouterr().err
    lines = [x for x in err.splitlines() if "is unusable" in x]
    assert len(lines) == 1 and lines[0].endswith("set aside as step_00000004.corrupt; no other checkpoint to "
                                                 "resume from"), err
    assert "falling back" not in err and "run the same command again to start the run afresh" in str(failure.value)
    assert not (root / "latest").exists() and (root / "step_00000004.corrupt").is_dir()
    from checkpoints.cli import main as checkpoints_main
    assert checkpoints_main(["verify", str(root), "--all"]) == 2  # nothing committed, and it says what is there
    assert "holds 1 set aside as corrupt, e.g. step_00000004.corrupt" in capfd.readouterr().err
    summary, _ = run(tiny_shards, tmp_path, 4)  # the advice, followed literally
    assert summary.start_step == 0 and summary.steps_done == 4
    assert "starting the run afresh" in capfd.readouterr().err
    assert (tmp_path / "metrics.1.jsonl").is_file() and (tmp_path / "COMPLETED").is_file()
    assert (root / "latest").read_text().strip() == "step_00000004"
    assert checkpoints_main(["verify", str(root), "--all"]) == 0


def test_failed_saves_are_recorded_and_a_failed_final_save_fails_the_run(tiny_shards, tmp_path, monkeypatch,
                                                                           capfd):
    """A periodic save that fails is a metrics record and training goes on; the final save failing is an error
    (exit 1 from the command line) with no COMPLETED marker, not a completed run; the re-run resumes from the last
    committed checkpoint."""
    import errno

    import checkpoints.files as ckpt_files
    from megaloop.train.checkpointing import SaveFailed

    real = ckpt_files.write_file

    def full_disk_at_steps_10_and_20(path, data):
        if "step_00000010" in str(path) or "step_00000020" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, data)

    monkeypatch.setattr(ckpt_files, "write_file", full_disk_at_steps_10_and_20)
    with pytest.raises(SaveFailed, match=r"final checkpoint \(step 20\) FAILED.*No space left on device"):
        run(tiny_shards, tmp_path, 20, "checkpoint.every=5")
    err = capfd.readouterr().err
    assert "checkpoint of step 10 FAILED" in err and "training goes on" in err, err
    assert not (tmp_path / "COMPLETED").exists() and not (tmp_path / "STOPPED").exists()
    failures = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "checkpoint_failed"]
    assert [(r["step"], r["fatal"]) for r in failures] == [(10, False), (20, True)], failures
    assert "No space left on device" in failures[0]["error"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000015"
    assert [CheckpointReader(p).step for p in find_checkpoints(tmp_path / "checkpoints")] == [15, 5]
    monkeypatch.setattr(ckpt_files, "write_file", real)
    again, _ = run(tiny_shards, tmp_path, 20)
    assert again.start_step == 15 and again.steps_done == 20
    assert json.loads((tmp_path / "COMPLETED").read_text()) == {"step": 20}


def test_time_limit_stops_saves_and_marks_for_requeue(tiny_shards, tmp_path):
    summary, _ = run(tiny_shards, tmp_path, 500, "train.time_limit_s=4")
    assert summary.interrupted and summary.stop_reason == "time limit" and 0 < summary.steps_done < 500
    stopped = json.loads((tmp_path / "STOPPED").read_text())
    assert stopped["step"] == summary.steps_done
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == f"step_{summary.steps_done:08d}"
    again, _ = run(tiny_shards, tmp_path, summary.steps_done + 2)
    assert again.start_step == summary.steps_done and not again.interrupted
    assert not (tmp_path / "STOPPED").exists()
    assert json.loads((tmp_path / "COMPLETED").read_text())["step"] == summary.steps_done + 2


def test_deadline_is_the_earlier_of_limit_and_environment():
    assert deadline_from(None, {}, now=100.0) is None
    assert deadline_from(50.0, {}, now=100.0) == 150.0
    assert deadline_from(50.0, {"MEGALOOP_DEADLINE": "120"}, now=100.0) == 120.0
    assert deadline_from(None, {"MEGALOOP_DEADLINE": "1e9"}, now=100.0) == 1e9
    with pytest.raises(ValueError, match="MEGALOOP_DEADLINE"):
        deadline_from(None, {"MEGALOOP_DEADLINE": "tomorrow"}, now=100.0)


def test_ranks_share_the_verification():
    from megaloop.train.checkpointing import verify_share

    sizes = {f"a{i}": size for i, size in enumerate([100, 90, 50, 40, 30, 20, 10, 10, 5])}
    shares = [verify_share(sizes, rank, 3) for rank in range(3)]
    assert sorted(n for share in shares for n in share) == sorted(sizes)  # every array once
    loads = [sum(sizes[n] for n in share) for share in shares]
    assert max(loads) - min(loads) <= max(sizes.values())  # balanced within one array
    assert verify_share(sizes, 0, 1) == sorted(sizes)
