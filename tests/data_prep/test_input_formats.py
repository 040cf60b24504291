"""The same documents stored as text files, parquet (several row groups), .jsonl.gz and .jsonl.zst read the same."""
from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from data_prep.errors import DataPrepError
from data_prep.inputs import detect_format, resolve_inputs
from data_prep.readers import ReadOptions, open_reader

DOCS = [f"document {i}\nline two é {'x' * i}\r\nend" for i in range(10)]
EXPECTED = [d.replace("\r\n", "\n") for d in DOCS]


def _texts(paths, **options):
    out = []
    for source in resolve_inputs([str(p) for p in paths]):
        reader = open_reader(source, ReadOptions(**options))
        out += [r.text for r in reader.read(0, len(reader.pieces())) if r.skip_reason is None]
    return out


def _jsonl(docs) -> bytes:
    return b"".join(json.dumps({"id": i, "text": d}).encode() + b"\n" for i, d in enumerate(docs))


@pytest.fixture
def corpora(tmp_path):
    text = tmp_path / "text"
    text.mkdir()
    for i, doc in enumerate(DOCS):
        (text / f"{i:02d}.txt").write_bytes(doc.encode())
    table = pa.table({"id": [str(i) for i in range(10)], "text": DOCS, "score": [1.0] * 10})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=3)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(_jsonl(DOCS)))
    zc = zstandard.ZstdCompressor()
    (tmp_path / "a.jsonl.zst").write_bytes(zc.compress(_jsonl(DOCS[:4])) + zc.compress(_jsonl(DOCS[4:])))
    return tmp_path


def test_every_format_gives_the_same_documents(corpora):
    assert _texts([corpora / "text"]) == EXPECTED
    assert _texts([corpora / "a.parquet"]) == EXPECTED
    assert _texts([corpora / "a.jsonl.gz"]) == EXPECTED
    assert _texts([corpora / "a.jsonl.zst"]) == EXPECTED  # two zstd frames


def test_parquet_pieces_are_row_groups_and_ranges_partition_the_rows(corpora):
    source = resolve_inputs([str(corpora / "a.parquet")])[0]
    reader = open_reader(source, ReadOptions())
    assert len(reader.pieces()) == 4 and all(size > 0 for size in reader.pieces())  # 3+3+3+1 rows
    keys = [r.key for r in reader.read(0, 2)] + [r.key for r in reader.read(2, 4)]
    assert keys == [f"a.parquet:{i}" for i in range(10)]


def test_detect_format_by_suffix():
    assert detect_format("x.jsonl.zst") == ("jsonl", "zstd")
    assert detect_format("x.ndjson.gz") == ("jsonl", "gzip")
    assert detect_format("x.md") == ("text", None)
    with pytest.raises(DataPrepError, match="parquet file compressed"):
        detect_format("x.parquet.gz")


@pytest.mark.parametrize("name", ["a.jsonl.gz", "a.jsonl.zst"])
def test_truncated_compressed_file_names_the_file(corpora, name):
    path = corpora / name
    path.write_bytes(path.read_bytes()[:-9])
    with pytest.raises(DataPrepError, match=f"{name}.*truncated"):
        _texts([path])


def test_truncated_parquet_is_refused(corpora):
    path = corpora / "a.parquet"
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(DataPrepError, match="not a readable parquet file"):
        _texts([path])


def test_missing_text_column_lists_the_columns(corpora):
    with pytest.raises(DataPrepError, match=r"no column 'body' \(columns: \['id', 'text', 'score'\]\)"):
        _texts([corpora / "a.parquet"], text_field="body")


def test_bad_json_line_errors_or_is_skipped(tmp_path):
    path = tmp_path / "b.jsonl"
    path.write_bytes(b'{"text": "one"}\n{"text": oops\n{"text": 3}\n{"text": "four"}\n')
    with pytest.raises(DataPrepError, match="b.jsonl line 2: not valid JSON"):
        _texts([path])
    assert _texts([path], on_bad_record="skip") == ["one", "four"]


def test_mixed_formats_and_format_mismatch_are_refused(corpora):
    with pytest.raises(DataPrepError, match="mix formats"):
        resolve_inputs([str(corpora / "a.parquet"), str(corpora / "a.jsonl.gz")])
    with pytest.raises(DataPrepError, match="--format parquet"):
        resolve_inputs([str(corpora / "a.jsonl.gz")], fmt="parquet")
    with pytest.raises(DataPrepError, match="more than once"):
        resolve_inputs([str(corpora / "a.parquet"), str(corpora / "a.parquet")])
    (corpora / "fake.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataPrepError, match="magic bytes"):
        resolve_inputs([str(corpora / "fake.parquet")])


def test_pretokenized_parquet_reads_ids_and_refuses_ids_past_the_vocabulary(tmp_path):
    from data_prep.readers.fields import check_token_ids

    ids = [[0, 5, 7], [], [9, 1]]
    pq.write_table(pa.table({"input_ids": ids}), tmp_path / "t.parquet", row_group_size=2)
    records = _records(tmp_path / "t.parquet", tokens_field="input_ids")
    assert [r.tokens for r in records] == ids
    assert [r.skip_reason for r in records] == [None, "missing or empty text field", None]
    check_token_ids(ids[0], 10, "t.parquet row 0")
    with pytest.raises(DataPrepError, match="token id 9 is not below the vocabulary size 9"):
        check_token_ids(ids[2], 9, "t.parquet row 2")


def _records(path, **options):
    source = resolve_inputs([str(path)])[0]
    reader = open_reader(source, ReadOptions(**options))
    return list(reader.read(0, len(reader.pieces())))
