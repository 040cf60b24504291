"""Bad input to `data_prep shards` over work units: one line naming the file (and row or line where known) and what
to do, exit status 2, and an output directory holding no manifest and no shard."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from data_prep.cli import main

from dp_testing import SEQ_LEN

DOCS = [{"text": f"document {i} " + "words and more words " * (5 + i), "id": f"d{i}", "int_score": i % 4}
        for i in range(12)]


def _jsonl(rows) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _parquet(path: Path, rows) -> None:
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=4)


def no_text_column(d: Path):
    _parquet(d / "a.parquet", [{"body": r["text"], "id": r["id"]} for r in DOCS])
    return [], ["a.parquet", "no column 'text'", "columns: ['body', 'id']"]


def truncated_parquet(d: Path):
    _parquet(d / "a.parquet", DOCS)
    data = (d / "a.parquet").read_bytes()
    (d / "a.parquet").write_bytes(data[: len(data) - 40])
    return [], ["a.parquet", "not a readable parquet file"]


def truncated_gzip(d: Path):
    (d / "a.jsonl.gz").write_bytes(gzip.compress(_jsonl(DOCS))[:-30])
    return [], ["a.jsonl.gz", "gzip stream is truncated"]


def truncated_zstd(d: Path):
    (d / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl(DOCS))[:-30])
    return [], ["a.jsonl.zst", "zstd stream is truncated"]


def bad_json_line(d: Path):
    (d / "a.jsonl").write_bytes(_jsonl(DOCS[:5]) + b'{"text": "cut off\n' + _jsonl(DOCS[5:]))
    return [], ["a.jsonl line 6", "not valid JSON", "--on-bad-record skip"]


def text_not_a_string(d: Path):
    rows = [dict(r) for r in DOCS]
    rows[7]["text"] = 12345
    (d / "a.jsonl").write_bytes(_jsonl(rows))
    return [], ["a.jsonl line 8", "field 'text' is a int, not a string"]


def token_id_too_large(d: Path):
    rows = [{"id": f"d{i}", "input_ids": list(range(5, 60))} for i in range(12)]
    rows[9]["input_ids"][3] = 4096
    _parquet(d / "a.parquet", rows)
    return ["--tokens-field", "input_ids", "--id-field", "id"], ["d9", "token id 4096", "vocabulary size 4096"]


def mixed_formats(d: Path):
    (d / "a.jsonl").write_bytes(_jsonl(DOCS))
    _parquet(d / "b.parquet", DOCS)
    return ["--format", "parquet"], ["a.jsonl is jsonl but --format parquet"]


def empty_selection(d: Path):
    (d / "a.jsonl").write_bytes(_jsonl(DOCS))
    return ["--glob", "*.parquet"], [str(d), "'*.parquet'"]


def pack_buffer_zero(d: Path):
    _parquet(d / "a.parquet", DOCS)
    return ["--pack-buffer", "0"], ["--pack-buffer must be at least 1 document, got 0"]


def pack_buffer_negative(d: Path):
    (d / "a.jsonl").write_bytes(_jsonl(DOCS))
    return ["--pack-buffer", "-1", "--packing", "stream"], ["--pack-buffer must be at least 1 document, got -1"]


CASES = [no_text_column, truncated_parquet, truncated_gzip, truncated_zstd, bad_json_line, text_not_a_string,
         token_id_too_large, mixed_formats, empty_selection, pack_buffer_zero, pack_buffer_negative]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_bad_input_is_one_line_exit_2_and_nothing_written(case, chapters_tokenizer, tmp_path, capsys):
    data = tmp_path / "in"
    data.mkdir()
    extra, expected = case(data)
    out = tmp_path / "out"
    code = main(["shards", "--input", str(data), "--tokenizer", str(chapters_tokenizer.directory), "--output",
                 str(out), "--seq-len", str(SEQ_LEN), "--val-fraction", "0.1", "--quiet", "--workers", "1", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and "What to do:" in err, err
    for part in expected:
        assert part in err, (part, err)
    assert not (out / "manifest.json").exists()
    assert not list(out.rglob("*.tar")) if out.exists() else True


def test_bad_records_are_skipped_and_counted_on_request(chapters_tokenizer, tmp_path, capsys):
    rows = [dict(r) for r in DOCS]
    rows[3]["text"] = ["not", "text"]
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_bytes(_jsonl(rows[:6]) + b"{broken\n" + _jsonl(rows[6:]))
    code = main(["shards", "--input", str(tmp_path / "in"), "--tokenizer", str(chapters_tokenizer.directory),
                 "--output", str(tmp_path / "out"), "--seq-len", "16", "--val-fraction", "0.1", "--quiet",
                 "--on-bad-record", "skip", "--min-chars", "150", "--filter", "int_score>=1", "--workers", "1"])
    assert code == 0, capsys.readouterr().err
    counts = json.loads((tmp_path / "out" / "manifest.json").read_text())["counts"]
    short = sum(1 for i, r in enumerate(DOCS) if i != 3 and len(r["text"]) < 150)
    low = sum(1 for i, r in enumerate(DOCS) if i != 3 and len(r["text"]) >= 150 and r["int_score"] < 1)
    assert counts["skipped_by_reason"] == {"bad record": 2, "fewer than 150 characters (--min-chars)": short,
                                           "filtered out by int_score>=1": low}
    assert counts["documents_used"] == 12 - 1 - short - low and short > 0 and low > 0


@pytest.mark.parametrize("where", ["https", "s3"])
def test_a_missing_remote_input_is_one_line_exit_2(where, chapters_tokenizer, tmp_path, capsys):
    from data_prep.local_servers import FileServer, S3Server

    (tmp_path / "served").mkdir()
    (tmp_path / "served" / "a.jsonl").write_bytes(_jsonl(DOCS))
    server = FileServer(tmp_path / "served") if where == "https" else S3Server()
    try:
        if where == "https":
            url, extra = f"{server.url}/b.jsonl", []
        else:
            url, extra = server.put_dir(tmp_path / "served", "bucket") + "/b.jsonl", ["--s3-endpoint", server.endpoint]
        code = main(["shards", "--input", url, "--tokenizer", str(chapters_tokenizer.directory), "--output",
                     str(tmp_path / "out"), "--seq-len", str(SEQ_LEN), "--quiet", *extra])
    finally:
        server.down() if where == "https" else server.close()
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert url in err and "no such object" in err and "check the --input URL" in err, err
    assert not (tmp_path / "out").exists()
