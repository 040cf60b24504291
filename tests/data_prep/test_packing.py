"""Best-fit packing (data_prep.packing), checked against the input documents without the packer's code.

The bundled corpus (data/sample_corpus, its first two novels) is cut into documents of web-page-like lengths
(benchmarks/data_prep_packing.web_like_documents, median 600 characters, so that some documents share a row and
some are cut), each opened by its own page number, and written both as a text directory (one stream) and as
parquet (work units). Rows are split at their BOS tokens back into the framed documents they hold; these are
matched to the documents encoded here, and the dropped, cut and padded counts made from that are compared with the
manifest's. A work-unit prep killed mid-way and re-run, and one on 2 workers, give the bytes of a straight run.
"""
from __future__ import annotations

import contextlib
import io
import json
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_prep.cli import main
from data_prep.inspect_cmd import inspect_shards
from data_prep.manifest import packing_of
from data_prep.packing import BestFitPacker
from data_prep.prepare import choose_validation
from data_prep.shard_reader import ShardDataset
from data_prep.shard_writer import RowPacker
from data_prep.text_io import normalise_text
from data_prep.unit_store import prep_dir

REPO = Path(__file__).resolve().parents[2]
SEQ = 256
UNIT_ARGS = ["--unit-mb", "0.12", "--pack-buffer", "200", "--id-field", "id"]


# ------------------------------------------------------------------------------------------- hand-made documents

def _pack(packer, docs):
    rows = [packer.add_document(np.array(d, dtype=np.uint16)) for d in docs]
    last, padded, _ = packer.finish(True)
    return np.concatenate(rows + [last]).tolist(), padded


def test_best_fit_on_hand_made_documents():
    # framed lengths 6, 3, 12, 4, 5; rows of 8; each choice among 3 buffered documents:
    # row 1: A (6, the longest that fits), then nothing fits 2: B, the shortest, is cut to 2 (1 token dropped);
    # row 2: E (5), then nothing fits 3: D (4) cut to 3 (1 dropped); row 3: C (12) cut to 8 (4 dropped)
    packer = BestFitPacker(8, 0, 1, 2, np.uint16, buffer=3)
    rows, padded = _pack(packer, [[5] * 4, [6], [7] * 10, [8] * 2, [9] * 3])
    assert rows == [[0, 5, 5, 5, 5, 1, 0, 6], [0, 9, 9, 9, 1, 0, 8, 8], [0, 7, 7, 7, 7, 7, 7, 7]]
    assert (packer.dropped_tokens, packer.cut_documents, packer.padded_tokens, padded) == (6, 3, 0, 0)
    # the last row is padded when the buffer runs dry: A (7); B (3) cut to the 1 left; then C (3) and 5 pads
    packer = BestFitPacker(8, 0, 1, 2, np.uint16, buffer=2)
    rows, padded = _pack(packer, [[5] * 5, [6], [7]])
    assert rows == [[0, 5, 5, 5, 5, 5, 1, 0], [0, 7, 1, 2, 2, 2, 2, 2]]
    assert (packer.dropped_tokens, packer.cut_documents, packer.padded_tokens, padded) == (2, 1, 5, 5)
    assert packer.stream_tokens == 2 * 8 - 5 + 2


def test_stream_counts_the_documents_of_its_dropped_tail():
    # stream of rows of 4: [0 5 1 0] [1 0 1]: the tail holds the end of the second document and all of the third
    packer = RowPacker(4, 0, 1, 2, np.uint16)
    for doc in ([5], [], []):
        packer.add_document(np.array(doc, dtype=np.uint16))
    assert packer.finish(False)[2] == 3 and (packer.dropped_tokens, packer.cut_documents) == (3, 2)


# ------------------------------------------------------------------------------------------- the bundled corpus

@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> dict:
    """Web-page-sized documents of two bundled novels, as a text directory and as parquet (the same ids)."""
    sys.path.insert(0, str(REPO))
    from benchmarks.data_prep_packing import web_like_documents

    novels = sorted((REPO / "data" / "sample_corpus").glob("*.txt"))[:2]
    texts = web_like_documents([normalise_text(p.read_bytes())[0] for p in novels], median_chars=600)
    docs = {f"page-{i:05d}.txt": f"Page {i}: {text}" for i, text in enumerate(texts)}
    root = tmp_path_factory.mktemp("pages")
    (root / "text").mkdir()
    for name, text in docs.items():
        (root / "text" / name).write_text(text, encoding="utf-8")
    (root / "parquet").mkdir()
    pq.write_table(pa.table({"text": list(docs.values()), "id": list(docs)}), root / "parquet" / "p.parquet",
                   row_group_size=64)
    return {"docs": docs, "text": root / "text", "parquet": root / "parquet"}


def _shards(inputs: Path, tok, out: Path, *extra, seq_len: int = SEQ) -> str:
    argv = ["shards", "--input", str(inputs), "--tokenizer", str(tok.directory), "--output", str(out), "--seq-len",
            str(seq_len), "--val-fraction", "0.05", "--shard-size", "500", "--quiet", *extra]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(argv) == 0
    return printed.getvalue()


@pytest.fixture(scope="module")
def one_stream(pages, chapters_tokenizer, tmp_path_factory):
    """The text directory in one stream, packing and buffer by default; (output, what the command printed)."""
    out = tmp_path_factory.mktemp("one_stream") / "out"
    return out, _shards(pages["text"], chapters_tokenizer, out, "--workers", "1")


@pytest.fixture(scope="module")
def units(pages, chapters_tokenizer, tmp_path_factory) -> Path:
    """The parquet in work units of ~0.12 MB, best fit from buffers of 200 documents, one worker."""
    out = tmp_path_factory.mktemp("units") / "out"
    _shards(pages["parquet"], chapters_tokenizer, out, *UNIT_ARGS, "--workers", "1")
    return out


def _framed(tok, texts) -> list[tuple]:
    return [(tok.bos_id, *tok.encode(t), tok.eos_id) for t in texts]


def _rows(out: Path, split: str) -> np.ndarray:
    data = ShardDataset(out, split, verify="full")
    return data.read_rows(np.arange(len(data), dtype=np.int64))


def _account(rows: np.ndarray, docs: list[tuple], tok) -> dict:
    """What the rows did to the documents, counted from the rows alone: every row starts at BOS, padding is a row's
    tail, the rows split at BOS into framed documents each of which is a whole document or (at a row's end) the
    start of one, and every document is in exactly one place. Returns dropped, cut and padded tokens/documents."""
    bos, eos, pad = tok.bos_id, tok.eos_id, tok.pad_id
    assert len(rows) and (rows[:, 0] == bos).all()
    whole, cut, padded, padded_rows = [], [], 0, []
    for number, row in enumerate(rows.tolist()):
        real = row.index(pad) if pad in row else len(row)
        assert set(row[real:]) <= {pad}
        if real < len(row):
            padded, padded_rows = padded + len(row) - real, padded_rows + [number]
        starts = [i for i in range(real) if row[i] == bos] + [real]
        for a, b in zip(starts, starts[1:]):
            (whole if row[b - 1] == eos else cut).append(tuple(row[a:b]))
            assert row[b - 1] == eos or b == len(row), "a cut document fills its row to the end"
    left = Counter(docs)
    for doc in whole:
        assert left[doc] > 0, "a whole document that is not an input document, or one placed twice"
        left[doc] -= 1
    left = list(left.elements())  # the documents not placed whole: each must be cut, once
    assert len(left) == len(cut)
    for part in sorted(cut, key=len, reverse=True):
        match = next((i for i, d in enumerate(left) if len(d) > len(part) and d[:len(part)] == part), None)
        assert match is not None, "a cut row-end that starts no remaining document"
        left[match] = ()  # taken: it is in no other row
    dropped = sum(len(d) for d in Counter(docs).elements()) - sum(map(len, whole)) - sum(map(len, cut))
    return {"dropped_tokens": dropped, "cut_documents": len(cut), "padded_tokens": padded,
            "padded_rows": padded_rows}


def test_one_stream_rows_start_at_bos_and_the_manifest_counts_what_the_rows_show(one_stream, pages,
                                                                                  chapters_tokenizer):
    out, printed = one_stream
    manifest = json.loads((out / "manifest.json").read_text())
    packing = manifest["packing"]
    assert {k: packing[k] for k in ("mode", "buffer", "bos_framed", "rows_start_at_bos")} == \
        {"mode": "bestfit", "buffer": 1000, "bos_framed": True, "rows_start_at_bos": True}
    val = choose_validation(list(pages["docs"]), 0.05)  # the documented split rule: by file name
    for split in ("train", "val"):
        names = [n for n in pages["docs"] if (n in val) == (split == "val")]
        rows = _rows(out, split)
        counted = _account(rows, _framed(chapters_tokenizer, [pages["docs"][n] for n in names]), chapters_tokenizer)
        assert counted.pop("padded_rows") in ([], [len(rows) - 1]), "padding only in a split's last row"
        assert packing["splits"][split] == counted
        info = manifest["splits"][split]
        assert info["padded_tokens"] == counted["padded_tokens"] and info["dropped_tail_tokens"] == 0
        assert info["stream_tokens"] == rows.size - counted["padded_tokens"] + counted["dropped_tokens"]
        assert f"{split}: {len(rows)} rows" in printed and (
            f"{counted['dropped_tokens']} tokens dropped, {counted['padded_tokens']} padded, "
            f"{counted['cut_documents']} documents cut") in printed
    assert counted["cut_documents"] > 0 and packing["splits"]["train"]["dropped_tokens"] > 0
    for name in ("dropped_tokens", "cut_documents", "padded_tokens"):
        assert packing[name] == sum(packing["splits"][s][name] for s in ("train", "val"))
    assert f"packing bestfit (buffer 1000): {packing['dropped_tokens']:,} tokens dropped" in printed


def test_work_units_keep_documents_whole_and_count_what_they_drop(units, pages, chapters_tokenizer):
    manifest = json.loads((units / "manifest.json").read_text())
    assert manifest["counts"]["units"] >= 5 and manifest["parameters"]["pack_buffer"] == 200
    rows = np.concatenate([_rows(units, "train"), _rows(units, "val")])
    counted = _account(rows, _framed(chapters_tokenizer, pages["docs"].values()), chapters_tokenizer)
    assert len(counted.pop("padded_rows")) <= 2 * manifest["counts"]["units"]  # only a unit's splits' last rows
    packing = manifest["packing"]
    assert {k: packing[k] for k in counted} == counted and packing["mode"] == "bestfit"
    for split, info in manifest["splits"].items():
        assert info["padded_tokens"] == packing["splits"][split]["padded_tokens"]


def test_the_last_rows_of_units_are_padded_and_counted(pages, chapters_tokenizer, tmp_path):
    """Rows of 2049 hold ~8 pages: each unit's splits end in a padded row when their buffers run dry."""
    out = tmp_path / "long_rows"
    _shards(pages["parquet"], chapters_tokenizer, out, *UNIT_ARGS, "--workers", "1", seq_len=2048)
    manifest = json.loads((out / "manifest.json").read_text())
    rows = np.concatenate([_rows(out, "train"), _rows(out, "val")])
    counted = _account(rows, _framed(chapters_tokenizer, pages["docs"].values()), chapters_tokenizer)
    assert manifest["counts"]["units"] < len(counted.pop("padded_rows")) <= 2 * manifest["counts"]["units"]
    assert {k: manifest["packing"][k] for k in counted} == counted and counted["padded_tokens"] > 0


@pytest.mark.multiproc
def test_a_killed_unit_prep_rerun_and_two_workers_give_the_same_bytes(units, pages, chapters_tokenizer, tmp_path):
    reference = _files(units)
    out = tmp_path / "killed"
    command = [sys.executable, "-m", "data_prep", "shards", "--input", str(pages["parquet"]), "--tokenizer",
               str(chapters_tokenizer.directory), "--output", str(out), "--seq-len", str(SEQ), "--val-fraction",
               "0.05", "--shard-size", "500", "--quiet", *UNIT_ARGS, "--workers", "1"]
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    units_dir = prep_dir(out) / "units"
    while proc.poll() is None and time.monotonic() < deadline and \
            sum(1 for d in units_dir.glob("*") if (d / "unit.json").exists()) < 2:
        time.sleep(0.005)
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL and not (out / "manifest.json").exists(), "killed before the end"
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert _files(out) == reference
    _shards(pages["parquet"], chapters_tokenizer, tmp_path / "two", *UNIT_ARGS, "--workers", "2")
    assert _files(tmp_path / "two") == reference


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_stream_packing_is_recorded_and_an_older_manifest_reads_as_stream(shard_copy):
    manifest = json.loads((shard_copy / "manifest.json").read_text())
    packing = manifest["packing"]
    assert (packing["mode"], packing["buffer"], packing["rows_start_at_bos"]) == ("stream", None, False)
    assert packing["dropped_tokens"] == sum(s["dropped_tail_tokens"] for s in manifest["splits"].values()) > 0
    del manifest["packing"]  # what versions before the packing record wrote
    (shard_copy / "manifest.json").write_text(json.dumps(manifest))
    older = packing_of(manifest)
    assert (older["mode"], older["recorded"], older["dropped_tokens"]) == ("stream", False, packing["dropped_tokens"])
    printed = io.StringIO()
    assert inspect_shards(shard_copy, verify="none", progress=False, out=printed) == 0
    assert "packing stream (not recorded: made before packing was)" in printed.getvalue()


def test_inspect_shows_the_packing(one_stream):
    out, _ = one_stream
    packing = json.loads((out / "manifest.json").read_text())["packing"]
    printed = io.StringIO()
    assert inspect_shards(out, verify="fast", progress=False, out=printed) == 0
    text = printed.getvalue()
    assert f"packing bestfit (buffer 1000): {packing['dropped_tokens']:,} tokens dropped" in text
    assert "every row starts at a document's BOS" in text
    train = packing["splits"]["train"]
    assert f"train {train['dropped_tokens']} dropped, {train['padded_tokens']} padded, " \
           f"{train['cut_documents']} documents cut" in text


def test_the_quickstart_corpus_needs_stream_packing(tmp_path, chapters_tokenizer):
    """Novels, one document each, keep one row each under best fit: the summary says so and what to do."""
    corpus = tmp_path / "novels"
    corpus.mkdir()
    for novel in sorted((REPO / "data" / "sample_corpus").glob("*.txt"))[:3]:
        shutil.copy(novel, corpus / novel.name)
    printed = _shards(corpus, chapters_tokenizer, tmp_path / "out", "--val-fraction", "0")
    assert "note: best fit dropped 99." in printed and "pass --packing stream" in printed
