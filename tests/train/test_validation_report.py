"""What the trainer reports about validation: no number without validation tokens (n/a instead of a "perfect" 0),
`[val]` lines that say their step, and a progress bar while validation runs."""
import json
import math

import torch

from megaloop.config import load_config
from megaloop.model import build_model
from megaloop.train.cli import format_summary
from megaloop.train.evaluate import validation_losses
from megaloop.train.progress import Progress, active
from megaloop.train.runtime import SingleProcessRuntime
from tests.train.conftest import TINY, fast_overrides


def test_shards_without_a_val_split_report_na_never_a_number(tiny_shards, tmp_path, capsys):
    from data_prep.prepare import ShardOptions, prepare_shards
    from megaloop.train.loop import train

    shards = tmp_path / "no_val"
    prepare_shards(tiny_shards.parent / "corpus", tiny_shards / "tokenizer", shards,
                   ShardOptions(seq_len=32, val_fraction=0.0, shard_size=256, progress=False))
    cfg = load_config(TINY, fast_overrides(shards, tmp_path / "out", steps=2))
    summary = train(cfg)
    assert summary.val, "the final validation still runs (and says there was nothing to measure)"
    for depth, v in summary.val.items():
        assert v["tokens"] == 0 and math.isnan(v["val_loss"]) and math.isnan(v["val_bpb"]), (depth, v)
    table = format_summary(cfg, summary)
    assert "n/a" in table and "no validation tokens" in table and "--val-fraction" in table, table
    assert "0.0000" not in table, table
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isnan(r["val_loss"]) for r in records if r["kind"] == "val")
    assert "has no val split, so there is no validation loss (reported as n/a)" in capsys.readouterr().err


def test_no_validation_batches_give_nan_not_zero():
    cfg = load_config(TINY, ["model.d_model=64", "model.n_heads=2", "model.seq_len=16", "model.vocab_size=256",
                             "model.ve_gate_channels=16"])
    model = build_model(cfg.model)
    result = validation_losses(model, [], [1, 2], 0, "fp32", torch.device("cpu"), SingleProcessRuntime("cpu"))
    assert all(math.isnan(v["val_loss"]) and v["tokens"] == 0 for v in result.values())


def test_val_lines_name_their_step_and_validation_shows_a_bar(capsys):
    cfg = load_config(TINY, ["model.d_model=64", "model.n_heads=2", "model.seq_len=16", "model.vocab_size=256",
                             "model.ve_gate_channels=16"])
    model = build_model(cfg.model)
    progress = Progress(10)
    try:
        record = {"mfu": float("nan"), "loss": 5.0, "tokens_per_s": 100.0, "mean_depth": 4.0}
        for _ in range(3):
            progress.update(record)
        assert active() is progress
        batches = [{"tokens": torch.randint(0, 256, (2, 17)), "sample_index": torch.arange(2)}]
        result = validation_losses(model, batches, [1, 2], 0, "fp32", torch.device("cpu"),
                                   SingleProcessRuntime("cpu"))
        assert all(v["tokens"] == 32 and math.isfinite(v["val_loss"]) for v in result.values())
        progress.note("T1:5.000 T4:nan")
    finally:
        progress.close()
    assert active() is None
    out, err = capsys.readouterr()
    assert "val at step 3" in err, err                     # the bar, on stderr
    assert "[val] step 3: T1:5.000 T4:n/a" in out, out     # the line, printed above the bars


def test_validation_turned_off_is_not_blamed_on_the_shards(tiny_shards, tmp_path):
    """data.val_batches=0 (what `megaloop bench` sets): the table says validation was off, and does not send the user
    to re-create shards that have a val split."""
    from megaloop.train.loop import RunSummary

    nan = float("nan")
    summary = RunSummary(steps_done=2, val={2: {"tokens": 0, "val_loss": nan, "val_bpb": nan}})
    off = format_summary(load_config(TINY, fast_overrides(tiny_shards, tmp_path, 2) + ["data.val_batches=0"]),
                         summary)
    assert "validation was off (data.val_batches=0" in off and "--val-fraction" not in off, off
    on = format_summary(load_config(TINY, fast_overrides(tiny_shards, tmp_path, 2)), summary)
    assert "--val-fraction" in on and "validation was off" not in on, on


def test_validation_off_is_noted_without_shard_advice(tiny_shards, tmp_path, capsys):
    from megaloop.train.data import open_data

    cfg = load_config(TINY, fast_overrides(tiny_shards, tmp_path, 2) + ["data.val_batches=0"])
    open_data(cfg, 0, 1).close()
    err = capsys.readouterr().err
    assert "validation is off (data.val_batches=0)" in err and "--val-fraction" not in err, err


def test_the_trainers_data_leaves_out_what_another_rank_could_not_read(tiny_shards, tmp_path):
    """data.on_corrupt=skip through the runtime's all_gather_object: a shard another rank reported unreadable is
    left out here too, before any batch (an independent count: the rows drop by that shard's rows)."""
    from data_prep.manifest import read_manifest
    from megaloop.train.data import open_data

    cfg = load_config(TINY, fast_overrides(tiny_shards, tmp_path, 2) + ["data.on_corrupt=skip"])
    shard = read_manifest(tiny_shards)["splits"]["train"]["shards"][0]
    alone = open_data(cfg, 0, 1)
    together = open_data(cfg, 0, 1, gather=lambda mine: [mine, [(0, shard["name"])]])
    try:
        assert together.loader.num_rows == alone.loader.num_rows - shard["rows"]
        assert [s["shard"] for s in together.loader.skipped] == [shard["name"]]
    finally:
        alone.close()
        together.close()
