"""model.doc_mask in the config tree: the BOS id comes from the shards' manifest (tokenizer.bos_id) when the config
is validated, documents must have been framed with it (the manifest's packing record; a manifest without one was
written by the BOS-framing stream packer), a contradicting model.bos_id, a tokenizer without BOS, or streamed shards
without the settings only they can give are one-line ConfigErrors; model.doc_attention_share is measured from the
train rows (mean over rows of sum len_d^2 / S^2, hand-computed here) and weighted by data.mix over corpora."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from data_prep.manifest import FORMAT, FORMAT_VERSION, write_manifest
from data_prep.shard_writer import SplitShardWriter
from megaloop.config import ConfigError, load_config

SEQ = 32
BOS = 1


def packed_rows(lengths_per_row, seed: int = 0) -> np.ndarray:
    """Rows of SEQ + 1 tokens: documents of the given lengths, each starting with BOS (the extra label token is
    not BOS)."""
    rng = np.random.default_rng(seed)
    rows = rng.integers(3, 200, size=(len(lengths_per_row), SEQ + 1))
    for row, lengths in zip(rows, lengths_per_row):
        for start in np.cumsum([0, *lengths[:-1]]):
            row[start] = BOS
    return rows.astype(np.uint16)


def shard_dir(path, rows: np.ndarray, bos=BOS, packing=None):
    """A one-split shard directory with a data_prep manifest (packing: the record, or None for none)."""
    path.mkdir()
    writer = SplitShardWriter(path, "train", 64, SEQ + 1, np.uint16)
    writer.add_rows(rows)
    shards = writer.close()
    tok = {"hash": "0" * 64, "vocab_size": 256, "eos_id": 2, "pad_id": 0}
    if bos is not None:
        tok["bos_id"] = bos
    manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "seq_len": SEQ, "row_len": SEQ + 1,
                "dtype": "uint16", "member_format": "{row:010d}.npy", "tokenizer": tok,
                "splits": {"train": {"rows": len(rows), "tokens": rows.size, "shards": shards}}}
    if packing is not None:
        manifest["packing"] = packing
    write_manifest(path, manifest)
    return path


def config(shards, *extra):
    return load_config(None, [f"data.shards={shards}", "model.vocab_size=256", f"model.seq_len={SEQ}",
                              "model.d_model=64", "model.n_heads=4", "model.doc_mask=true", *extra])


def test_bos_id_and_attention_share_come_from_the_shards(tmp_path):
    # rows: documents 5, 9, 18 | 32 | 16, 16: (25 + 81 + 324) / 1024, 1, 512 / 1024
    shards = shard_dir(tmp_path / "a", packed_rows([[5, 9, 18], [32], [16, 16]]))
    cfg = config(shards)
    assert cfg.model.bos_id == BOS
    assert cfg.model.doc_attention_share == pytest.approx((430 / 1024 + 1 + 512 / 1024) / 3, abs=1e-15)
    again = config(shards, "model.bos_id=1", "model.doc_attention_share=0.25")  # given: kept
    assert again.model.doc_attention_share == 0.25
    assert config(shards).validate().model.bos_id == BOS  # validating twice keeps them
    off = load_config(None, [f"data.shards={shards}", "model.vocab_size=256", f"model.seq_len={SEQ}"])
    assert off.model.bos_id is None and off.model.doc_attention_share is None  # doc_mask off: nothing filled


def test_a_mixture_weighs_each_corpus_share(tmp_path):
    one = shard_dir(tmp_path / "one", packed_rows([[32]]))  # share 1
    halves = shard_dir(tmp_path / "halves", packed_rows([[16, 16]] * 3))  # share 1/2, three rows
    by_rows = config(f"[{one}, {halves}]")
    assert by_rows.model.doc_attention_share == pytest.approx((1 * 1 + 3 * 0.5) / 4, abs=1e-15)
    by_mix = config(f"[{one}, {halves}]", "data.mix=[0.5, 0.5]")
    assert by_mix.model.doc_attention_share == pytest.approx(0.75, abs=1e-15)


@pytest.mark.parametrize("problem, match", [
    ("no bos", r"model.doc_mask=True: the shards in .* tokenizer without a BOS token .*set model.doc_mask=false"),
    ("not framed", r"model.doc_mask=True: .*not framed with BOS \(packing.bos_framed false\)"),
    ("other bos", r"model.bos_id=5: the shards in .* mark documents with BOS id 1; set model.bos_id=1"),
    ("streamed", r"model.bos_id=None: model.doc_mask=true with streamed shards .* needs model.bos_id and "
                 r"model.doc_attention_share set"),
])
def test_doc_mask_refusals_are_one_line(tmp_path, problem, match):
    rows = packed_rows([[5, 9, 18]])
    if problem == "no bos":
        shards, extra = shard_dir(tmp_path / "s", rows, bos=None), []
    elif problem == "not framed":
        shards, extra = shard_dir(tmp_path / "s", rows, packing={"mode": "stream", "bos_framed": False}), []
    elif problem == "other bos":
        shards, extra = shard_dir(tmp_path / "s", rows), ["model.bos_id=5"]
    else:
        shards, extra = "s3://bucket/shards", []
    with pytest.raises(ConfigError, match=match) as err:
        config(shards, *extra)
    assert "\n" not in str(err.value)


def test_a_packing_record_that_frames_with_bos_is_accepted(tmp_path):
    record = {"mode": "bestfit", "buffer": 1000, "bos_framed": True, "rows_start_at_bos": True}
    shards = shard_dir(tmp_path / "s", packed_rows([[5, 9, 18]]), packing=record)
    assert config(shards).model.bos_id == BOS
    streamed = load_config(None, ["data.shards=s3://bucket/shards", "model.doc_mask=true", "model.bos_id=1",
                                  "model.doc_attention_share=0.5"])
    assert streamed.model.doc_attention_share == 0.5


def test_doc_mask_without_shards_or_bos_id_is_one_line_at_check(capsys):
    """No shards to take the BOS id from and none given: refused when the config is checked, not when the model is
    built (a traceback)."""
    from megaloop.__main__ import main

    tiny = str(Path(__file__).resolve().parents[2] / "configs" / "parcae-tiny.yaml")
    assert main(["check", tiny, "--set", "model.doc_mask=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.doc_mask=true needs the BOS token id" in err[0] and "set model.bos_id" in err[0]
    assert main(["check", tiny, "--set", "model.doc_mask=true", "--set", "model.bos_id=0"]) == 0
