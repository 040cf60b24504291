"""Loss-spike detection (megaloop.train.spikes): the rule on hand-made series, and a run forced to diverge by a
learning-rate spike: the spike is logged at the step whose loss jumps, on_spike=stop saves and stops there, and
on_spike=skip drops that step's update."""
import dataclasses
import json
import math

import numpy as np
import pytest

from megaloop.config import load_config
from megaloop.optim.combined import CombinedOptimizer
from megaloop.train.cli import run_training
from megaloop.train.metrics import read_metrics
from megaloop.train.spikes import MAD_FLOOR, SpikeDetector
from tests.train.conftest import TINY, fast_overrides


def test_detector_flags_loss_above_median_plus_k_mad():
    rng = np.random.default_rng(0)
    base = 3.0 + 0.01 * rng.standard_normal(30)
    det = SpikeDetector(k=6.0, window=30, min_history=20)
    assert [det.check(i, v) for i, v in enumerate(base)] == [None] * 30
    h = base[-30:]
    median, mad = np.median(h), np.median(np.abs(h - np.median(h)))
    just_below, just_above = median + 6 * mad - 1e-9, median + 6 * mad + 1e-9
    spike = det.check(30, just_above)
    assert spike is not None and spike.step == 30 and spike.threshold == pytest.approx(median + 6 * mad, abs=1e-12)
    assert det.check(31, just_below) is None
    assert det.check(32, float("nan")).step == 32  # a non-finite loss is a spike
    assert det.check(33, float("inf")) is not None


def test_no_judgement_before_history_and_mad_floor():
    det = SpikeDetector(k=6.0, window=50, min_history=20)
    assert all(det.check(i, 100.0 if i == 5 else 2.0) is None for i in range(21))  # too early to judge step 5
    # a flat history (MAD 0): the floor MAD_FLOOR x median keeps rounding noise from counting as a spike
    det = SpikeDetector(k=6.0, window=20, min_history=20)
    for i in range(20):
        det.check(i, 2.0)
    assert det.check(20, 2.0 + 5 * MAD_FLOOR * 2.0) is None
    assert det.check(21, 2.0 + 7 * MAD_FLOOR * 2.0) is not None


SPIKE_AT = 24  # the loss of this step jumps: the update of step SPIKE_AT - 1 ran at 300x the learning rate


@pytest.fixture
def lr_spike(monkeypatch):
    original = CombinedOptimizer.schedule_at

    def schedule_at(self, step):
        values = original(self, step)
        if step != SPIKE_AT - 1:
            return values
        return dataclasses.replace(values, matrix_lr=values.matrix_lr * 300, adam_lr=values.adam_lr * 300)

    monkeypatch.setattr(CombinedOptimizer, "schedule_at", schedule_at)


def _run(tiny_shards, out, action):
    overrides = fast_overrides(tiny_shards, out, steps=SPIKE_AT + 4) + [
        f"train.on_spike={action}", "train.val_every=1000", "train.spike_window=20"]
    cfg = load_config(TINY, overrides)
    return run_training(cfg), read_metrics(out / "metrics.jsonl")


def test_lr_spike_is_logged_and_stop_ends_the_run_with_a_checkpoint(tiny_shards, tmp_path, lr_spike, capsys):
    code, records = _run(tiny_shards, tmp_path, "stop")
    spikes = [r for r in records if r["kind"] == "spike"]
    assert [s["step"] for s in spikes] == [SPIKE_AT], spikes
    s = spikes[0]
    assert s["loss"] > s["threshold"] and s["action"] == "stop" and 0 < s["rho_A"] < 1 and s["state_norm"] > 0
    train_steps = [r["step"] for r in records if r["kind"] == "train"]
    assert max(train_steps) == SPIKE_AT  # nothing after the spike step
    assert code == 75
    assert f"loss spike at step {SPIKE_AT}" in capsys.readouterr().err
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.is_dir())
    assert any(str(SPIKE_AT + 1) in name for name in ckpts), ckpts
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps_done"] == SPIKE_AT + 1 and summary["interrupted"]


def test_skip_drops_the_spike_steps_update(tiny_shards, tmp_path, lr_spike):
    code, records = _run(tiny_shards, tmp_path, "skip")
    assert code == 0
    spikes = [r for r in records if r["kind"] == "spike"]
    assert spikes and spikes[0]["step"] == SPIKE_AT and spikes[0]["action"] == "skip"
    by_step = {r["step"]: r for r in records if r["kind"] == "train"}
    skipped = {s["step"] for s in spikes}
    assert all(by_step[t]["skipped"] and math.isnan(by_step[t]["grad_norm"]) for t in skipped)
    assert not by_step[SPIKE_AT - 1]["skipped"]


def test_skip_decisions_survive_a_resume(tiny_shards, tmp_path, lr_spike):
    """The detector's window is checkpointed: a run stopped just before the spike and resumed skips the same update
    as the straight run, and its losses are the straight run's bit for bit (a fresh window after the resume could
    not judge the spike: it needs SPIKE_MIN_HISTORY losses)."""
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    _, records = _run(tiny_shards, straight, "skip")
    cfg = load_config(TINY, fast_overrides(tiny_shards, stopped, steps=SPIKE_AT + 4) + [
        "train.on_spike=skip", "train.val_every=1000", "train.spike_window=20", f"train.stop_at_step={SPIKE_AT - 2}"])
    assert run_training(cfg) == 75
    code, resumed = _run(tiny_shards, stopped, "skip")
    assert code == 0
    assert any(r["kind"] == "resume" and r["step"] == SPIKE_AT - 2 for r in resumed)
    assert [r["step"] for r in resumed if r["kind"] == "spike"] == [r["step"] for r in records if r["kind"] == "spike"]
    losses = {r["step"]: r["loss"] for r in records if r["kind"] == "train"}
    after = {r["step"]: r["loss"] for r in resumed if r["kind"] == "train" and r["step"] >= SPIKE_AT - 2}
    assert after and all(after[s] == losses[s] for s in after), (after, losses)
