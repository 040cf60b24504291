"""A short training run end to end: metrics.jsonl follows its schema, TensorBoard reads the event files, the run is
deterministic, validation runs at fixed depths, and a stop request ends the run cleanly with everything written."""
import json
import math

import pytest

from megaloop.config import load_config
from megaloop.train.loop import train
from megaloop.train.metrics import SCHEMA, read_metrics, validate_record
from tests.train.conftest import TINY, fast_overrides


@pytest.fixture(scope="module")
def run(tiny_shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    cfg = load_config(TINY, fast_overrides(tiny_shards, out))
    return cfg, train(cfg), out


def test_metrics_follow_schema(run):
    cfg, summary, out = run
    records = read_metrics(out / "metrics.jsonl")
    train_recs = [r for r in records if r["kind"] == "train"]
    val_recs = [r for r in records if r["kind"] == "val"]
    assert [r["step"] for r in train_recs] == list(range(cfg.train.steps))
    for r in records:
        validate_record(r)
        assert set(SCHEMA[r["kind"]]) <= set(r)
    assert all(r["tokens"] == 8 * 32 for r in train_recs)
    assert all(0 < r["rho_A"] < 1 and r["useful_flops"] <= r["executed_flops"] for r in train_recs)
    assert all(math.isfinite(r["loss"]) and r["tokens_per_s"] > 0 for r in train_recs)
    # periodic validation after step 3 at T = 1, 2, 4, mu_rec=4, 8; the final one at every T in 1..2 mu_rec
    assert sorted({(r["step"], r["T"]) for r in val_recs}) == [(3, t) for t in (1, 2, 4, 8)] + [
        (6, t) for t in range(1, 9)]
    assert json.loads((out / "summary.json").read_text())["steps_done"] == cfg.train.steps


def test_schema_rejects_bad_records():
    good = {"kind": "val", "step": 1, "T": 2, "val_loss": 1.0, "val_bpb": 1.0, "tokens": 3, "rows": 1}
    validate_record(good)
    with pytest.raises(ValueError, match="lacks 'T'"):
        validate_record({k: v for k, v in good.items() if k != "T"})
    with pytest.raises(ValueError, match="val_loss"):
        validate_record({**good, "val_loss": "1.0"})
    with pytest.raises(ValueError, match="kind"):
        validate_record({**good, "kind": "other"})


def test_tensorboard_reads_event_files(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg, _, out = run
    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert "train/loss" in tags and "val/loss_T4" in tags and "train/mfu" in tags
    losses = [e.value for e in acc.Scalars("train/loss")]
    jsonl = [r["loss"] for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]
    assert losses == pytest.approx(jsonl, rel=1e-6)


def test_same_seed_same_losses(run, tiny_shards, tmp_path):
    cfg, summary, _ = run
    again = train(load_config(TINY, fast_overrides(tiny_shards, tmp_path)))
    assert again.losses == summary.losses
    other = train(load_config(TINY, fast_overrides(tiny_shards, tmp_path / "s1") + ["train.seed=1"]))
    assert other.losses != summary.losses


def test_stop_request_ends_cleanly(tiny_shards, tmp_path, monkeypatch):
    import megaloop.train.loop as loop

    real = loop.train_step
    calls = {"n": 0}

    def step_then_stop(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            import os
            import signal
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C sends
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "train_step", step_then_stop)
    summary = train(load_config(TINY, fast_overrides(tiny_shards, tmp_path, steps=50)))
    assert summary.interrupted and summary.steps_done == 2
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "train"] == [0, 1]
    assert not any(r["kind"] == "val" for r in records), "no validation sweep on the way out"
    assert json.loads((tmp_path / "summary.json").read_text())["interrupted"] is True
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_00000002"  # saved where it stopped
