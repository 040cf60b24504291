"""Checkpoint cadence (checkpoint.every_minutes, megaloop.train.cadence) and epochs (data.max_epochs, the epoch in
every step record): the interval rule by hand, a run killed at a random time losing at most one interval of work,
and a corpus small enough to wrap within a few steps."""
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megaloop.config import load_config
from megaloop.train.cadence import AUTO_COST, AUTO_MIN_MINUTES, Cadence, auto_interval_s
from megaloop.train.cli import run_training
from megaloop.train.heartbeat import read_heartbeats
from megaloop.train.metrics import read_metrics
from megaloop.train.stopping import SAVE_DUE_CODE, SIGNAL_CODES, STOP_CODES, TIME_LIMIT_CODE, job_stop_code
from tests.train.conftest import TINY, fast_overrides

REPO = Path(__file__).resolve().parents[2]


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_fixed_interval_is_due_after_its_minutes_and_restarts_at_each_save():
    clock = Clock()
    cadence = Cadence(2.5, clock=clock)
    clock.now += 149.9
    assert not cadence.due()
    clock.now += 0.1
    assert cadence.due()
    cadence.saved()
    assert not cadence.due()
    assert Cadence(0, clock=clock).interval_s() is None and not Cadence(0, clock=clock).due()


def test_auto_interval_keeps_saves_at_two_percent_of_the_time():
    assert AUTO_COST == 0.02
    assert auto_interval_s(0.0, 0.0) == AUTO_MIN_MINUTES * 60  # nothing measured yet: the floor
    assert auto_interval_s(30.0, 10.0) == 30.0 / 0.02  # a 30 s stall: every 25 minutes
    assert auto_interval_s(1.0, 2000.0) == 2000.0  # a write slower than that: never two writes at once
    clock = Clock()
    cadence = Cadence("auto", clock=clock)
    clock.now += 1499.0
    assert not cadence.due(30.0, 10.0)
    clock.now += 1.0
    assert cadence.due(30.0, 10.0) and cadence.describe(30.0, 10.0) == "every 25 min (auto)"


def test_a_stop_outranks_a_due_save_in_the_job_code():
    def counts(**by_code):
        return [by_code.get(f"c{code}", 0) for code in range(1, STOP_CODES + 1)]

    assert job_stop_code(counts(**{f"c{SAVE_DUE_CODE}": 1})) == SAVE_DUE_CODE
    assert job_stop_code(counts(**{f"c{SAVE_DUE_CODE}": 3, f"c{TIME_LIMIT_CODE}": 1})) == TIME_LIMIT_CODE
    usr1 = SIGNAL_CODES[signal.SIGUSR1]
    assert job_stop_code(counts(**{f"c{SAVE_DUE_CODE}": 1, f"c{usr1}": 1})) == usr1


def test_a_run_killed_at_a_random_time_loses_at_most_one_interval(tiny_shards, tmp_path):
    """checkpoint.every_minutes=0.02 (1.2 s) and steps slowed to ~0.12 s: kill -9 at a random time; the newest
    committed checkpoint's step finished at most one interval (plus a step, and the write of a save still in flight)
    before the last step that finished, as the heartbeat's per-step times say."""
    interval = 0.02 * 60
    out = tmp_path / "run"
    overrides = fast_overrides(tiny_shards, out, steps=400) + [
        "checkpoint.every_minutes=0.02", "checkpoint.keep=100", "train.heartbeat_every=1", "train.val_every=100000",
        ]
    env = {**os.environ, "MEGALOOP_FAULTS": "slow:rank=0,seconds=0.1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "megaloop", "train", str(TINY), *[a for o in overrides for a in ("--set", o)]]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "heartbeat" / "rank_0.jsonl").exists() and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.2)
        time.sleep(random.Random().uniform(5.0, 8.0))
        assert proc.poll() is None, proc.stderr.read()
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
    beats = {b["step"]: b for b in read_heartbeats(out)[0] if b["event"] == "step"}
    last = max(beats)
    saved = sorted(int(p.name.split("_")[1]) for p in (out / "checkpoints").glob("step_*") if (p / "COMMIT").exists())
    assert saved, "no time-based checkpoint was committed"
    step_s = max(b["step_time"] for b in beats.values())
    lost_s = beats[last]["time"] - beats[saved[-1]]["time"]
    gaps = [beats[b]["time"] - beats[a]["time"] for a, b in zip(saved, saved[1:])]
    print(f"killed after step {last}; checkpoints at steps {saved}; gaps between saves {[round(g, 2) for g in gaps]} s"
          f"; work lost {lost_s:.2f} s (interval {interval} s, slowest step {step_s:.2f} s)")
    assert lost_s <= interval + 2 * step_s
    assert all(interval - 1e-6 <= g <= interval + 2 * step_s for g in gaps)  # by the clock, not by a step count


@pytest.fixture(scope="module")
def small_shards(tiny_shards, tmp_path_factory):
    """A corpus of a few dozen rows, so that an epoch is a handful of 8-row batches."""
    from data_prep.prepare import ShardOptions, prepare_shards

    root = tmp_path_factory.mktemp("small_data")
    (root / "corpus").mkdir()
    text = next((tiny_shards.parent / "corpus").glob("*.txt")).read_text()[:2500]
    (root / "corpus" / "one.txt").write_text(text)
    prepare_shards(root / "corpus", tiny_shards.parent / "tok", root / "shards",
                   ShardOptions(seq_len=32, val_fraction=0.0, shard_size=256, progress=False))
    return root / "shards"


def test_epochs_are_in_the_records_and_max_epochs_ends_the_run(small_shards, tmp_path, capsys):
    manifest = json.loads((small_shards / "manifest.json").read_text())
    rows, G = manifest["splits"]["train"]["rows"], 8
    assert 2 * G < rows < 6 * G  # a few steps per epoch
    cfg = load_config(TINY, fast_overrides(small_shards, tmp_path, steps=200) + [
        "data.max_epochs=2", "train.val_every=100000", f"data.global_batch_size={G}", "data.val_batches=0"])
    assert run_training(cfg) == 0
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    expected = [((k + 1) * G - 1) // rows for k in range(len(records))]  # the epoch of each step's last sample
    assert [r["epoch"] for r in records] == expected
    # the run ends before the first batch holding a sample of epoch 2
    assert ((len(records) + 1) * G - 1) // rows >= 2 and expected[-1] == 1
    done = json.loads((tmp_path / "COMPLETED").read_text())
    assert done == {"step": len(records), "reason": "data.max_epochs=2 reached"}
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["epoch"] == 1 and summary["steps_done"] == len(records)
    err = capsys.readouterr().err
    assert err.count("the corpus wrapped") == 1
