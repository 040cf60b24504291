"""Bad input: each case is a clear error (what was wrong, what to do) or a documented, counted skip."""
from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest

from data_prep.errors import (CorruptShardError, DataPrepError, EmptyCorpusError, NotEnoughTokensError,
                             TokenizerMismatchError)
from data_prep.inspect_cmd import inspect_shards
from data_prep.loader import ShardLoader
from data_prep.manifest import read_manifest
from data_prep.prepare import ShardOptions, prepare_shards
from data_prep.shard_reader import ShardDataset
from data_prep.shard_writer import member_name
from data_prep.tokenizer import train_tokenizer

from dp_testing import SEQ_LEN


def _options(**overrides):
    return ShardOptions(**{"seq_len": SEQ_LEN, "shard_size": 100, "val_fraction": 0.0, "progress": False,
                           **overrides})


def _first_train_shard(shard_dir):
    return read_manifest(shard_dir)["splits"]["train"]["shards"][0]


def test_empty_directory(tmp_path, chapters_tokenizer):
    (tmp_path / "in").mkdir()
    with pytest.raises(EmptyCorpusError, match="holds no file.*What to do: point --input"):
        prepare_shards(tmp_path / "in", chapters_tokenizer.directory, tmp_path / "out", _options())
    with pytest.raises(EmptyCorpusError):
        train_tokenizer(tmp_path / "in", tmp_path / "tok", vocab_size=300, progress=False)
    assert not (tmp_path / "out").exists()


def test_binary_and_unreadable_files_are_skipped_and_counted(small_corpus, chapters_tokenizer, tmp_path):
    corpus = tmp_path / "in"
    shutil.copytree(small_corpus, corpus)
    (corpus / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 8)
    (corpus / "random.bin").write_bytes(np.random.default_rng(0).integers(128, 256, 5000, dtype=np.uint8).tobytes())
    (corpus / "empty.txt").write_bytes(b"")
    manifest = prepare_shards(corpus, chapters_tokenizer.directory, tmp_path / "out", _options())
    counts = manifest["counts"]
    assert counts["files_listed"] == 28 and counts["files_used"] == 25 and counts["files_skipped"] == 3
    assert counts["skipped_by_reason"] == {"binary (NUL byte)": 1, "mostly invalid UTF-8": 1, "empty": 1}
    skipped = {s["path"]: s for s in manifest["sources"] if s["skipped"]}
    assert set(skipped) == {"image.png", "random.bin", "empty.txt"}
    assert all(s["tokens"] == 0 and s["split"] is None for s in skipped.values())


def test_invalid_utf8_is_replaced_and_counted(small_corpus, chapters_tokenizer, tmp_path):
    corpus = tmp_path / "in"
    corpus.mkdir()
    text = (small_corpus / sorted(p.name for p in small_corpus.iterdir())[0]).read_bytes()[:3000]
    (corpus / "stray.txt").write_bytes(b"Stray \xff\xfe bytes and a cut \xe2\x82 char. " + text)
    (corpus / "z_clean.txt").write_bytes(text)
    manifest = prepare_shards(corpus, chapters_tokenizer.directory, tmp_path / "out", _options())
    assert manifest["counts"]["replaced_bytes"] == 4 and manifest["counts"]["files_with_replaced_bytes"] == 1
    stray = next(s for s in manifest["sources"] if s["path"] == "stray.txt")
    assert stray["replaced_bytes"] == 4 and stray["skipped"] is None
    first_row = ShardDataset(tmp_path / "out", verify="full")[0]
    assert chapters_tokenizer.decode(first_row[:30]).startswith("<|bos|>Stray \ufffd\ufffd bytes and a cut \ufffd")


def test_truncated_tar(shard_copy):
    shard = _first_train_shard(shard_copy)
    path = shard_copy / shard["name"]
    path.write_bytes(path.read_bytes()[:shard["size"] // 2 + 100])
    with pytest.raises(CorruptShardError, match=f"{shard['name']}: truncated.*What to do: restore"):
        ShardLoader(shard_copy, 12)
    with pytest.raises(CorruptShardError) as caught:           # no size check: the index finds the damage
        ShardDataset(shard_copy, verify="none")[0]
    assert caught.value.shard == shard["name"] and caught.value.member is not None
    assert f"member {caught.value.member}" in str(caught.value)
    loader = ShardLoader(shard_copy, 12, on_corrupt="skip")
    total = read_manifest(shard_copy)["splits"]["train"]["rows"]
    assert loader.num_rows == total - shard["rows"] and [s["shard"] for s in loader.skipped] == [shard["name"]]
    assert next(iter(loader))["tokens"].shape == (12, SEQ_LEN + 1)
    loader.close()
    assert inspect_shards(shard_copy, "fast", progress=False, out=io.StringIO()) == 1


def test_checksum_mismatch(shard_copy):
    shard = _first_train_shard(shard_copy)
    path = shard_copy / shard["name"]
    data = bytearray(path.read_bytes())
    data[512 + 128 + 10] ^= 0x01                              # a token of the first row; size unchanged
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match=f"{shard['name']}: checksum mismatch"):
        ShardLoader(shard_copy, 12, verify="full")
    ShardLoader(shard_copy, 12, verify="fast").close()        # documented: "fast" checks sizes only
    skipping = ShardLoader(shard_copy, 12, verify="full", on_corrupt="skip")
    assert skipping.skipped[0]["shard"] == shard["name"] and "checksum" in skipping.skipped[0]["problem"]
    report = io.StringIO()
    assert inspect_shards(shard_copy, "full", progress=False, out=report) == 1
    assert f"BAD {shard['name']}: checksum mismatch" in report.getvalue()


def test_damaged_member_is_named_even_without_checksums(shard_copy):
    shard = _first_train_shard(shard_copy)
    path = shard_copy / shard["name"]
    data = bytearray(path.read_bytes())
    stride = 512 + ((128 + 2 * (SEQ_LEN + 1) + 511) // 512) * 512
    data[3 * stride + 512 + 1] = ord("X")                     # break the .npy magic of the 4th member
    data[5 * stride + 512 + 128: 5 * stride + 512 + 130] = b"\xff\xff"   # token id 65535 >= vocab in the 6th
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match=f"member {member_name(shard['first_row'] + 3)}"):
        ShardDataset(shard_copy, verify="none")[0]
    data[3 * stride + 512 + 1] = ord("N")
    path.write_bytes(bytes(data))
    dataset = ShardDataset(shard_copy, verify="none")
    with pytest.raises(CorruptShardError, match=f"{member_name(5)}: row holds token ids >= vocab size"):
        dataset.read_rows(np.arange(8))
    loader = ShardLoader(shard_copy, 12, prefetch=2)             # raised by the prefetch thread, seen here
    with pytest.raises(CorruptShardError, match=f"{member_name(5)}: row holds token ids"):
        for _ in loader:
            pass
    assert loader.step < loader.num_rows // 12 + 1


def test_seq_len_that_no_document_can_fill(small_corpus, chapters_tokenizer, tmp_path):
    with pytest.raises(NotEnoughTokensError, match=r"fewer than seq_len \+ 1.*What to do: lower --seq-len"):
        prepare_shards(small_corpus, chapters_tokenizer.directory, tmp_path / "a", _options(seq_len=10**8))
    corpus = tmp_path / "short"
    corpus.mkdir()
    (corpus / "a.txt").write_text("A short document. " * 40)   # 720 bytes, far fewer tokens
    with pytest.raises(NotEnoughTokensError, match="the train split has .* tokens in 1 documents"):
        prepare_shards(corpus, chapters_tokenizer.directory, tmp_path / "b", _options(seq_len=700))
    assert not list((tmp_path / "b").glob("*.tar")) and not (tmp_path / "b" / "manifest.json").exists()
    manifest = prepare_shards(corpus, chapters_tokenizer.directory, tmp_path / "c",
                              _options(seq_len=700, keep_last_partial=True))
    assert manifest["splits"]["train"]["rows"] == 1 and manifest["splits"]["train"]["padded_tokens"] > 0


def test_tokenizer_hash_differs_from_manifest(small_shards, small_corpus, tmp_path):
    other = train_tokenizer(small_corpus, tmp_path / "other", vocab_size=300, progress=False)
    recorded = read_manifest(small_shards)["tokenizer"]["hash"]
    assert other.hash != recorded
    with pytest.raises(TokenizerMismatchError, match="shards were made with tokenizer.*What to do: use the tokenizer"):
        ShardLoader(small_shards, 12, tokenizer_hash=other.hash)
    report = io.StringIO()
    assert inspect_shards(small_shards, "fast", tokenizer_dir=other.directory, progress=False, out=report) == 1
    assert "shards were made with tokenizer" in report.getvalue()
    ShardLoader(small_shards, 12, tokenizer_hash=recorded).close()


def test_missing_or_foreign_manifest(tmp_path):
    with pytest.raises(Exception, match="has no manifest.json.*What to do"):
        ShardLoader(tmp_path, 12)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "something else"}))
    with pytest.raises(Exception, match="not a data_prep manifest"):
        ShardLoader(tmp_path, 12)


def test_a_split_left_empty_by_skipped_files_is_an_error(small_corpus, chapters_tokenizer, tmp_path):
    corpus = tmp_path / "in"
    corpus.mkdir()
    shutil.copyfile(sorted(small_corpus.glob("*.txt"))[0], corpus / "good.txt")
    (corpus / "garbage.txt").write_bytes(bytes(range(128, 256)) * 100)   # no NUL: only found when read
    with pytest.raises(NotEnoughTokensError, match="split is empty .*skipped.*What to do: check the skipped"):
        prepare_shards(corpus, chapters_tokenizer.directory, tmp_path / "out", _options(val_fraction=0.5))
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_replaced_byte_counts_cover_only_files_that_were_used(small_corpus, chapters_tokenizer, tmp_path):
    corpus = tmp_path / "in"
    corpus.mkdir()
    text = (small_corpus / sorted(p.name for p in small_corpus.iterdir())[0]).read_bytes()[:3000]
    (corpus / "stray.txt").write_bytes(b"Stray \xff\xfe bytes and a cut \xe2\x82 char. " + text)
    (corpus / "garbage.txt").write_bytes(bytes(range(128, 256)) * 100)   # mostly invalid: skipped, 12800 replaced
    (corpus / "z_clean.txt").write_bytes(text)
    manifest = prepare_shards(corpus, chapters_tokenizer.directory, tmp_path / "out", _options())
    counts = manifest["counts"]
    assert counts["skipped_by_reason"] == {"mostly invalid UTF-8": 1}
    assert counts["replaced_bytes"] == 4 and counts["files_with_replaced_bytes"] == 1, counts
    tok = train_tokenizer(corpus, tmp_path / "tok", vocab_size=300, progress=False)
    assert tok.config["training_corpus"]["replaced_bytes"] == 4


class _Interrupt(KeyboardInterrupt):
    pass


@pytest.mark.parametrize("failure", [RuntimeError("disk full"), _Interrupt()])
def test_interrupted_overwrite_leaves_the_old_shards_intact(shard_copy, small_corpus, chapters_tokenizer,
                                                           monkeypatch, failure):
    from data_prep import shard_writer

    before = {p.name: p.read_bytes() for p in shard_copy.iterdir() if p.is_file()}
    real_add = shard_writer.SplitShardWriter.add_rows
    calls = []

    def failing_add(self, rows):
        calls.append(len(rows))
        if len(calls) == 5:                   # mid-write: some new shards already exist
            raise failure
        return real_add(self, rows)

    monkeypatch.setattr(shard_writer.SplitShardWriter, "add_rows", failing_add)
    with pytest.raises(type(failure)):
        prepare_shards(small_corpus, chapters_tokenizer.directory, shard_copy,
                       _options(seq_len=32, overwrite=True, val_fraction=0.1))
    assert len(calls) == 5
    after = {p.name: p.read_bytes() for p in shard_copy.iterdir() if p.is_file()}
    assert after == before, "the old shards and manifest must be left exactly as they were"
    assert sorted(p.name for p in shard_copy.iterdir() if p.is_dir()) == ["tokenizer"], "no staging left behind"
    assert inspect_shards(shard_copy, "full", progress=False, out=io.StringIO()) == 0
    assert ShardDataset(shard_copy, verify="full")[0].shape == (SEQ_LEN + 1,)

    monkeypatch.setattr(shard_writer.SplitShardWriter, "add_rows", real_add)   # a complete overwrite swaps
    manifest = prepare_shards(small_corpus, chapters_tokenizer.directory, shard_copy,
                              _options(seq_len=32, overwrite=True, val_fraction=0.1))
    names = {s["name"] for split in manifest["splits"].values() for s in split["shards"]}
    assert {p.name for p in shard_copy.glob("*.tar")} == names
    assert read_manifest(shard_copy)["seq_len"] == 32 and ShardDataset(shard_copy)[0].shape == (33,)


def test_a_manifest_whose_seq_len_contradicts_its_rows(shard_copy):
    path = shard_copy / "manifest.json"
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps({**manifest, "seq_len": 2 * SEQ_LEN}))            # rows still hold SEQ_LEN + 1
    with pytest.raises(DataPrepError, match=f"records seq_len {2 * SEQ_LEN} but rows of {SEQ_LEN + 1} tokens"):
        read_manifest(shard_copy)
    path.write_text(json.dumps({**manifest, "seq_len": 2 * SEQ_LEN, "row_len": 2 * SEQ_LEN + 1}))
    report = io.StringIO()
    assert inspect_shards(shard_copy, "full", progress=False, out=report) >= 1
    assert (f"holds a row of {SEQ_LEN + 1} tokens (seq_len {SEQ_LEN}), but the manifest records seq_len "
            f"{2 * SEQ_LEN}") in report.getvalue()
    with pytest.raises(CorruptShardError, match=f"holds a row of {SEQ_LEN + 1} tokens"):
        ShardLoader(shard_copy, 12, verify="fast").batch(0)


def _data_prep(*args, **kwargs):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    kwargs = {"capture_output": True, **kwargs} if "stdout" not in kwargs else kwargs
    return subprocess.run([sys.executable, "-m", "data_prep", *map(str, args)], text=True, cwd=repo, timeout=120,
                          **kwargs)


def _assert_one_line_error(done, *expected):
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "What to do" in lines[0], done.stderr
    for text in expected:
        assert text in lines[0], lines[0]


def test_command_line_bad_input_is_one_line(small_shards, small_corpus, chapters_tokenizer, tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    _assert_one_line_error(_data_prep("tokenizer", "--input", small_corpus, "--output", a_file, "--quiet"),
                           f"--output {a_file} is a file, not a directory")
    for option, value, expected in (("--min-frequency", -1, "--min-frequency must be >= 0"),
                                    ("--max-bytes", 0, "--max-bytes must be at least 1"),
                                    ("--vocab-size", 10**11, "vocab size 100000000000 is above 16777216")):
        _assert_one_line_error(_data_prep("tokenizer", "--input", small_corpus, "--output", tmp_path / "tok",
                                          option, value, "--quiet"), expected)
    _assert_one_line_error(_data_prep("shards", "--input", small_corpus, "--tokenizer", chapters_tokenizer.directory,
                                      "--output", a_file, "--seq-len", 32, "--quiet"),
                           f"--output {a_file} is a file, not a directory")
    for buffer in (0, -5):  # a text directory (one stream) and work units: refused before anything is written
        for engine in ("stream", "units"):
            out = tmp_path / f"buffer{buffer}_{engine}"
            _assert_one_line_error(_data_prep("shards", "--input", small_corpus, "--tokenizer",
                                              chapters_tokenizer.directory, "--output", out, "--seq-len", 32,
                                              "--pack-buffer", buffer, "--engine", engine, "--quiet"),
                                   f"--pack-buffer must be at least 1 document, got {buffer}", "--pack-buffer 1000")
            assert not out.exists()
    _assert_one_line_error(_data_prep("inspect", small_shards, "--split", "test", "--quiet"),
                           "--split 'test' is not a split of", "['train', 'val']")
    _assert_one_line_error(_data_prep("inspect", small_shards, "--sample-tokens", -1, "--quiet"),
                           "--sample-tokens must be >= 0")
    _assert_one_line_error(_data_prep("inspect", small_shards, "--tokenizer", tmp_path / "nope", "--quiet"),
                           "is not a directory")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "manifest.json").write_text('{"format": "megaloop-data_prep-shards",')
    _assert_one_line_error(_data_prep("inspect", broken, "--quiet"), "manifest.json is not valid JSON")


def test_inspect_reports_a_seq_len_that_contradicts_the_rows(shard_copy):
    path = shard_copy / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "seq_len": 2 * SEQ_LEN}))
    _assert_one_line_error(_data_prep("inspect", shard_copy, "--quiet"),
                           f"records seq_len {2 * SEQ_LEN} but rows of {SEQ_LEN + 1} tokens")


def test_inspect_into_a_closed_pipe_is_quiet(small_shards):
    """`inspect ... | head -1`: the reader has gone when inspect writes; no BrokenPipeError traceback."""
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)                                             # every write now fails with EPIPE
    try:
        done = _data_prep("inspect", small_shards, "--quiet", stdout=write_end, stderr=-1)
    finally:
        os.close(write_end)
    assert done.returncode == 141 and "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
