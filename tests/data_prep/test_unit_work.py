"""A unit's shards hold exactly the hand-packed stream of its documents, split by the corpus-wide rule."""
from __future__ import annotations

import io
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data_prep.inputs import resolve_inputs
from data_prep.prepare import choose_validation
from data_prep.readers import ReadOptions, open_reader
from data_prep.unit_work import write_unit
from data_prep.units import plan_units

BOS, EOS, PAD = 0, 1, 2
SEQ = 4


def _encode(text):
    return np.frombuffer(text.encode(), dtype=np.uint8).astype(np.uint16) % 50 + 3


def _rows(path):
    with tarfile.open(path) as tar:
        return [np.load(io.BytesIO(tar.extractfile(m).read())) for m in tar.getmembers()]


def test_unit_rows_match_a_hand_packed_stream(tmp_path):
    texts = [f"doc {i} " + "y" * (i * 3) for i in range(8)] + [""]
    pq.write_table(pa.table({"text": texts}), tmp_path / "c.parquet", row_group_size=3)
    files = resolve_inputs([str(tmp_path / "c.parquet")])
    pieces = [(f, open_reader(f, ReadOptions()).pieces()) for f in files]
    unit = plan_units(pieces, unit_bytes=1 << 30, fingerprint="f")[0]
    out = tmp_path / "u"
    out.mkdir()
    summary = write_unit(unit, out, ReadOptions(), _encode, (BOS, EOS, PAD), 64, SEQ, shard_size=3,
                         val_fraction=0.25, dtype=np.uint16)
    keys = [f"c.parquet:{i}" for i in range(8)]
    val = choose_validation(keys, 0.25)
    assert len(val) == 2 and summary["skipped_by_reason"] == {"missing or empty text field": 1}
    for split, chosen in (("train", [k for k in keys if k not in val]), ("val", [k for k in keys if k in val])):
        stream = np.concatenate([np.r_[BOS, _encode(texts[int(k.split(":")[1])]), EOS] for k in chosen])
        full = len(stream) // (SEQ + 1)
        expected = stream[:full * (SEQ + 1)].reshape(full, SEQ + 1)
        shards = summary["splits"][split]["shards"]
        assert [s["name"] for s in shards] == [f"{split}-000000-{k:04d}.tar" for k in range(len(shards))]
        got = np.concatenate([np.stack(_rows(out / s["name"])) for s in shards])
        np.testing.assert_array_equal(got, expected)
        assert summary["splits"][split]["dropped_tail_tokens"] == len(stream) - full * (SEQ + 1)
