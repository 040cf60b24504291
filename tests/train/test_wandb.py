"""train.wandb: rank 0 logs the metrics.jsonl records to a W&B run in <out_dir>/wandb (here offline: WANDB_MODE=offline,
nothing reaches the network), a job that resumes the run continues the same W&B run, and train.wandb where wandb is
not installed is a one-line config error (exit 2) before anything is written."""
from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from megaloop.config import ConfigError, load_config
from megaloop.train.loop import train
from megaloop.train.metrics import read_metrics
from megaloop.train.wandb_log import run_id_path, split_target, wandb_values
from tests.train.conftest import TINY, fast_overrides

REPO = Path(__file__).resolve().parents[2]
STEPS, STOP = 20, 12
BLOCK = 32768  # the transaction log's block size (the LevelDB log format)
HEADER = b":W&B\xe1\xbe\x00"  # its file header: ":W&B", magic 0xBEE1 (little-endian), version 0


def offline_env(folder: Path) -> dict:
    """wandb writes locally only: offline, silent, no console capture, code, git or system metrics, and its
    user-level folders in this test's folder."""
    return {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off", "WANDB_DISABLE_CODE": "true",
            "WANDB_DISABLE_GIT": "true", "WANDB_X_DISABLE_STATS": "true", "WANDB_X_DISABLE_META": "true",
            "WANDB_CONFIG_DIR": str(folder / "config"), "WANDB_CACHE_DIR": str(folder / "cache"),
            "WANDB_DATA_DIR": str(folder / "data"), "WANDB_ARTIFACT_DIR": str(folder / "artifacts")}


def log_chunks(data: bytes):
    """The records of a transaction log, joined from their fragments: blocks of BLOCK bytes, each record fragment
    behind a 7-byte header (crc32 4, length 2, type 1: 1 whole, 2 first, 3 middle, 4 last); a block's tail shorter
    than a header is padding."""
    assert data[:len(HEADER)] == HEADER, data[:len(HEADER)]
    pos, pending = len(HEADER), b""
    while pos + 7 <= len(data):
        if BLOCK - pos % BLOCK < 7:
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        body, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            pending = body
        elif kind in (3, 4):
            pending += body
        if kind in (1, 4):
            yield pending


def read_offline_run(path: Path) -> dict:
    """An offline run's .wandb file: its run id, config and history rows (key -> value, as logged)."""
    from wandb.proto.wandb_internal_pb2 import Record

    found = {"history": []}
    for chunk in log_chunks(path.read_bytes()):
        record = Record()
        record.ParseFromString(chunk)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            found["run_id"] = record.run.run_id
            found["config"] = {item.key: json.loads(item.value_json) for item in record.run.config.update}
        elif kind == "history":
            found["history"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                     for item in record.history.item})
    return found


def offline_runs(out: Path) -> list[dict]:
    """Every job's offline run under <out>/wandb, oldest first."""
    files = sorted((out / "wandb").glob("offline-run-*/run-*.wandb"))
    return [read_offline_run(f) for f in files]


def run_job(shards: Path, out: Path, *extra: str):
    cfg = load_config(TINY, [*fast_overrides(shards, out, steps=STEPS), "train.val_every=10", "train.wandb=test",
                             "train.heartbeat_every=0", *extra])
    return train(cfg)


@pytest.fixture(scope="module")
def runs(tiny_shards, tmp_path_factory):
    """One run of STEPS steps in a single job, and one in two jobs (stopped after STOP steps, then re-run)."""
    root = tmp_path_factory.mktemp("wandb")
    straight, split = root / "straight", root / "split"
    with pytest.MonkeyPatch.context() as mp:
        for key, value in offline_env(root).items():
            mp.setenv(key, value)
        run_job(tiny_shards, straight)
        first = run_job(tiny_shards, split, f"train.stop_at_step={STOP}")
        second = run_job(tiny_shards, split)
    assert first.interrupted and first.steps_done == STOP
    assert second.start_step == STOP and second.steps_done == STEPS
    return straight, split


def logged(runs: list[dict], key: str) -> dict:
    """step -> the value of `key` over the jobs' history rows (a later job's row replaces an earlier one's)."""
    return {row["step"]: row[key] for run in runs for row in run["history"] if key in row}


def jsonl(out: Path, kind: str, field: str, **match) -> dict:
    return {r["step"]: r[field] for r in read_metrics(out / "metrics.jsonl")
            if r["kind"] == kind and all(r[k] == v for k, v in match.items())}


def test_offline_run_holds_the_jsonl_records(runs):
    """The offline run of one job: the train losses, learning rates, skips, rho(A), tokens/s and the validation losses
    per depth at the same steps with the same values as metrics.jsonl; the config is the run's config."""
    straight, _ = runs
    found = offline_runs(straight)
    assert len(found) == 1
    losses = logged(found, "train/loss")
    print(f"W&B train/loss at {len(losses)} steps, first {losses[0]:.6f}, last {losses[STEPS - 1]:.6f}")
    assert losses == jsonl(straight, "train", "loss") and sorted(losses) == list(range(STEPS))
    for key in ("lr", "rho_A", "tokens_per_s", "skipped_total", "mean_depth"):
        assert logged(found, f"train/{key}") == jsonl(straight, "train", key), key
    assert logged(found, "train/skipped") == {s: int(v) for s, v in jsonl(straight, "train", "skipped").items()}
    val = jsonl(straight, "val", "val_loss", T=4)
    assert val and logged(found, "val/loss_T4") == val
    config = json.loads((straight / "config.json").read_text())
    assert {k: found[0]["config"][k] for k in config} == config
    assert found[0]["run_id"] == run_id_path(straight).read_text().strip()


def test_resumed_job_continues_the_same_run(runs):
    """Two jobs of one run: both offline runs carry the id stored in <out_dir>/wandb/run_id, the second logs the
    resume and the steps from STOP on, and together they hold metrics.jsonl's losses."""
    straight, split = runs
    found = offline_runs(split)
    stored = run_id_path(split).read_text().strip()
    assert len(found) == 2 and [f["run_id"] for f in found] == [stored, stored]
    assert stored != run_id_path(straight).read_text().strip()
    assert sorted(logged(found[:1], "train/loss")) == list(range(STOP))
    assert sorted(logged(found[1:], "train/loss")) == list(range(STOP, STEPS))
    assert list(logged(found, "resume/from")) == [STOP]
    assert logged(found, "train/loss") == jsonl(split, "train", "loss")


def test_records_become_wandb_rows():
    """W&B keys: <kind>/<field>, val losses per depth under TensorBoard's names, booleans as 0/1, non-finite numbers
    and lists left out; train.wandb names a project or an entity's project."""
    assert wandb_values({"kind": "train", "step": 3, "loss": 2.5, "skipped": True, "mfu": float("nan")}) == {
        "step": 3, "train/loss": 2.5, "train/skipped": 1}
    assert wandb_values({"kind": "val", "step": 4, "T": 8, "val_loss": 1.5, "val_bpb": 0.5, "tokens": 9,
                         "rows": 1}) == {"step": 4, "val/loss_T8": 1.5, "val/bpb_T8": 0.5}
    assert wandb_values({"kind": "rollback", "step": 5, "restored_step": 4, "skipped_batches": [5]}) == {
        "step": 5, "rollback/restored_step": 4}
    assert split_target("proj") == (None, "proj") and split_target("team/proj") == ("team", "proj")
    for bad in ("a/b/c", "/proj", "team/", "pro#j"):
        with pytest.raises(ConfigError, match="train.wandb"):
            load_config(TINY, [f"train.wandb={bad}"], validate=False).train.validate()


def test_missing_wandb_is_a_one_line_config_error(tiny_shards, tmp_path):
    """train.wandb without wandb installed (hidden from the process: sys.modules["wandb"] = None, which importlib's
    find_spec reports as absent): exit 2, one line naming the key and the install command, no train.out_dir."""
    out = tmp_path / "out"
    sets = [a for o in fast_overrides(tiny_shards, out) + ["train.wandb=test"] for a in ("--set", o)]
    code = ("import sys; sys.modules['wandb'] = None; from megaloop.__main__ import main; "
            f"sys.exit(main(['train', {str(TINY)!r}, *{sets!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    lines = proc.stderr.strip().splitlines()
    print(lines)
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("megaloop: config error: train.wandb='test'"), proc.stderr
    assert "pip install -r requirements-wandb.txt" in lines[0]
    assert not out.exists()
