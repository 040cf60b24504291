"""Loss-spike detection (megaloop.train.spikes): the rule on hand-made series, and a run forced to diverge by a
learning-rate spike: the spike is logged at the step whose loss jumps, on_spike=stop stops there without saving its
state, on_spike=skip drops that step's update, and on_spike=rollback (a corrupted batch injected with
MEGALOOP_FAULTS) restores the checkpoint before it and skips the batches up to it."""
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


def _run(tiny_shards, out, action, *extra):
    overrides = fast_overrides(tiny_shards, out, steps=SPIKE_AT + 4) + [
        f"train.on_spike={action}", "train.val_every=1000", "train.spike_window=20", *extra]
    cfg = load_config(TINY, overrides)
    return run_training(cfg), read_metrics(out / "metrics.jsonl")


def test_lr_spike_is_logged_and_stop_keeps_only_checkpoints_from_before_it(tiny_shards, tmp_path, lr_spike, capsys):
    """on_spike=stop: nothing is saved after the spike, the checkpoint of the spike's own step (its state already
    holds the 300x update that made the loss jump) is set aside, and the STOPPED marker says not to requeue."""
    code, records = _run(tiny_shards, tmp_path, "stop", "checkpoint.every=12")
    spikes = [r for r in records if r["kind"] == "spike"]
    assert [s["step"] for s in spikes] == [SPIKE_AT], spikes
    s = spikes[0]
    assert s["loss"] > s["threshold"] and s["action"] == "stop" and 0 < s["rho_A"] < 1 and s["state_norm"] > 0
    train_steps = [r["step"] for r in records if r["kind"] == "train"]
    assert max(train_steps) == SPIKE_AT  # nothing after the spike step
    assert code == 75
    assert f"loss spike at step {SPIKE_AT}" in capsys.readouterr().err
    root = tmp_path / "checkpoints"
    names = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert names == ["step_00000012", f"step_{SPIKE_AT:08d}.after-spike"], names
    assert (root / "latest").read_text().strip() == "step_00000012"
    stopped = json.loads((tmp_path / "STOPPED").read_text())
    assert stopped["requeue"] is False and stopped["step"] == 12 and "loss spike" in stopped["reason"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps_done"] == SPIKE_AT + 1 and summary["interrupted"] and summary["spike_stop"]


def test_rollback_restores_skips_the_corrupted_batch_and_finishes(tiny_shards, tmp_path, monkeypatch):
    """A corrupted batch at a known step (every token replaced: its loss jumps) under on_spike=rollback: the run
    restores the checkpoint before it, skips train.rollback_skip global batches ending at the corrupted one, and
    finishes with finite losses; the steps after the rollback read the batches after the window (checked against
    the sample indices the loader gives), and a resume from a checkpoint after the rollback reads the same."""
    spike_at, skip, G = 26, 3, 8
    monkeypatch.setenv("MEGALOOP_FAULTS", f"spike:step={spike_at}")
    steps = spike_at + 6
    cfg = load_config(TINY, fast_overrides(tiny_shards, tmp_path, steps=steps) + [
        "train.on_spike=rollback", "train.val_every=1000", "train.spike_window=20", "checkpoint.every=12",
        f"train.rollback_skip={skip}", f"data.global_batch_size={G}"])
    assert run_training(cfg) == 0
    records = read_metrics(tmp_path / "metrics.jsonl")
    spikes = [r for r in records if r["kind"] == "spike"]
    assert [(r["step"], r["action"]) for r in spikes] == [(spike_at, "rollback")]
    rollback = [r for r in records if r["kind"] == "rollback"]
    assert len(rollback) == 1
    r = rollback[0]
    assert r["restored_step"] == 24 and r["step"] == spike_at and r["rollbacks"] == 1
    assert r["skipped_batches"] == [spike_at - 2, spike_at - 1, spike_at]
    assert r["skipped_samples"] == [[(spike_at - 2) * G, (spike_at + 1) * G]]
    by_step = {}
    for rec in records:
        if rec["kind"] == "train":
            by_step[rec["step"]] = rec  # the last record of a step (the replay after the rollback) wins
    assert sorted(by_step) == list(range(steps)) and all(math.isfinite(v["loss"]) for v in by_step.values())
    assert all(v["loss"] < spikes[0]["threshold"] for k, v in by_step.items() if k >= 24)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps_done"] == steps and len(summary["rollbacks"]) == 1
    # the checkpoint at the end says where the loader is: `skip` batches past the step
    meta = json.loads(next((tmp_path / "checkpoints").glob(f"step_{steps:08d}/metadata.json")).read_text())
    assert meta["loader"]["step"] == steps + skip
    assert meta["trainer"]["skip_windows"] == {"offset": skip, "rollbacks": 1,
                                               "windows": [[spike_at - 2, spike_at]]}


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
