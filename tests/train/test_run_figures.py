"""What a run reports is true: the final summary's MFU of a multi-process run is the job's useful FLOPs over the
job's peak (every process's device), the same figure its per-step records give; a run whose steps are all skipped
for a non-finite gradient norm stops with a message naming the likely cause instead of ending with rc 0."""
from __future__ import annotations

import json

import pytest

import megaloop.optim.combined as combined
from megaloop.config import load_config
from megaloop.train.cli import run_training
from tests.train.conftest import TINY, fast_overrides
from tests.train.test_agreed_stop import command, launch, wait_all


@pytest.mark.multiproc
def test_summary_mfu_of_two_processes_matches_the_step_records(tiny_shards, tmp_path):
    procs = launch(command(tiny_shards, tmp_path / "run", tp=1) + ["--set", "train.steps=6"], 2, tmp_path)
    assert wait_all(procs, 600) == [0, 0], (tmp_path / "rank0.log").read_text()[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if r["kind"] == "train"]
    by_steps = sum(r["mfu"] * r["time_step"] for r in steps) / sum(r["time_step"] for r in steps)
    by_summary = summary["useful_flops"] / summary["train_time_s"] / (summary["peak_tflops"] * 1e12)
    print(f"dp2: summary MFU {by_summary:.4%}, time-weighted step MFU {by_steps:.4%}, peak {summary['peak_tflops']:.3f} "
          f"TFLOP/s ({summary['peak_source']})")
    assert by_summary == pytest.approx(by_steps, rel=1e-9)
    assert summary["peak_source"].startswith("2 x ")


def test_all_skipped_steps_stop_the_run_with_the_cause(tiny_shards, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(combined, "clip_grads", lambda *a, **k: float("nan"))  # every gradient norm non-finite
    cfg = load_config(TINY, fast_overrides(tiny_shards, tmp_path, steps=50) + ["train.max_consecutive_skips=4"])
    rc = run_training(cfg)
    header, *err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1
    assert header.startswith(f"megaloop: train {tmp_path}: ") and "precision fp32 (set in the config" in header
    assert len(err) == 1 and "stopped at step 3" in err[0] and "the last 4 steps were all skipped" in err[0]
    assert "learning rate" in err[0] and "Traceback" not in err[0]
