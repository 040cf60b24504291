"""Sharding (small scale): packing, manifest, validation split, determinism, plain tar/webdataset."""
from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import tarfile
import textwrap

import numpy as np
import pytest

from data_prep.errors import DataPrepError
from data_prep.manifest import read_manifest, verify_shards
from data_prep.prepare import ShardOptions, choose_validation, prepare_shards
from data_prep.shard_reader import ShardDataset
from data_prep.shard_writer import MemberHeaders, member_name, npy_header, tar_header
from data_prep.text_io import iter_documents, list_source_files

from dp_testing import ROWS_PER_SHARD, SEQ_LEN


def _all_rows(shard_dir, split):
    dataset = ShardDataset(shard_dir, split, verify="none")
    return dataset.read_rows(np.arange(len(dataset)))


def test_manifest_counts_and_checksums(small_shards):
    manifest = read_manifest(small_shards)
    assert verify_shards(small_shards, manifest, "full") == {}
    assert manifest["seq_len"] == SEQ_LEN and manifest["row_len"] == SEQ_LEN + 1 and manifest["dtype"] == "uint16"
    for split, info in manifest["splits"].items():
        assert sum(s["rows"] for s in info["shards"]) == info["rows"] > 0
        assert all(s["rows"] == ROWS_PER_SHARD for s in info["shards"][:-1])
        assert info["tokens"] == info["rows"] * (SEQ_LEN + 1)
        assert info["stream_tokens"] == info["tokens"] + info["dropped_tail_tokens"]
        assert info["documents"] == sum(1 for s in manifest["sources"] if s["split"] == split)
        for shard in info["shards"]:
            data = (small_shards / shard["name"]).read_bytes()
            assert len(data) == shard["size"] and hashlib.sha256(data).hexdigest() == shard["sha256"]
    assert manifest["counts"]["files_used"] == len(manifest["sources"]) == 25
    assert all(len(s["sha256"]) == 64 and s["size"] > 0 for s in manifest["sources"])
    assert manifest["parameters"]["shard_size"] == ROWS_PER_SHARD and "workers" not in manifest["parameters"]


def test_rows_are_the_documents_framed_by_bos_eos(small_shards, small_corpus, chapters_tokenizer):
    manifest, tok = read_manifest(small_shards), chapters_tokenizer
    documents = {d.relpath: d.text for d in iter_documents(small_corpus, list_source_files(small_corpus))}
    assert "\r" not in documents["novel_excerpt.txt"] and not documents["novel_excerpt.txt"].startswith("\ufeff")
    for split in ("train", "val"):
        stream = []
        for source in manifest["sources"]:
            if source["split"] == split:
                ids = tok.encode_hf(documents[source["path"]])
                assert len(ids) == source["tokens"]
                stream += [tok.bos_id] + ids + [tok.eos_id]
        rows = _all_rows(small_shards, split)
        assert rows.reshape(-1).tolist() == stream[:rows.size]
        assert len(stream) - rows.size == manifest["splits"][split]["dropped_tail_tokens"] < SEQ_LEN + 1


def test_validation_split_is_by_document_and_depends_only_on_names(small_shards):
    manifest = read_manifest(small_shards)
    val = {s["path"] for s in manifest["sources"] if s["split"] == "val"}
    train = {s["path"] for s in manifest["sources"] if s["split"] == "train"}
    assert val and train and not val & train
    names = [s["path"] for s in manifest["sources"]]
    assert choose_validation(names, 0.1) == choose_validation(list(reversed(names)), 0.1) == val
    assert len(choose_validation(names, 0.5)) == round(0.5 * len(names))
    assert choose_validation(names, 0.0) == set()


def test_output_is_identical_for_any_number_of_workers(small_corpus, chapters_tokenizer, small_shards, tmp_path):
    options = ShardOptions(seq_len=SEQ_LEN, shard_size=ROWS_PER_SHARD, val_fraction=0.1, workers=2, progress=False)
    prepare_shards(small_corpus, chapters_tokenizer.directory, tmp_path / "w2", options)
    reference = sorted(p.relative_to(small_shards) for p in small_shards.rglob("*") if p.is_file())
    produced = sorted(p.relative_to(tmp_path / "w2") for p in (tmp_path / "w2").rglob("*") if p.is_file())
    assert produced == reference and len(reference) > 4
    for rel in reference:
        assert (tmp_path / "w2" / rel).read_bytes() == (small_shards / rel).read_bytes(), rel


def test_plain_tar_lists_and_extracts_the_rows(small_shards, tmp_path):
    manifest = read_manifest(small_shards)
    shard = manifest["splits"]["train"]["shards"][1]
    listing = subprocess.run(["tar", "--numeric-owner", "-tvf", str(small_shards / shard["name"])],
                             capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(listing) == shard["rows"]
    assert listing[0].split()[:2] == ["-rw-r--r--", "0/0"] and "1970-01-01" in listing[0]
    assert listing[0].split()[-1] == member_name(shard["first_row"])
    subprocess.run(["tar", "-xf", str(small_shards / shard["name"]), "-C", str(tmp_path)], check=True)
    rows = _all_rows(small_shards, "train")
    for i in (0, shard["rows"] - 1):
        loaded = np.load(tmp_path / member_name(shard["first_row"] + i))
        assert loaded.dtype == np.uint16 and np.array_equal(loaded, rows[shard["first_row"] + i])


def test_member_offsets_in_the_manifest_are_the_tar_offsets_and_reading_scans_no_tar(small_shards, monkeypatch):
    from data_prep.reindex import scan_members

    manifest = read_manifest(small_shards)
    header = len(npy_header(manifest["dtype"], manifest["row_len"]))
    for entry in manifest["splits"]["train"]["shards"][:2] + manifest["splits"]["val"]["shards"][-1:]:
        _, offsets, _ = scan_members(small_shards / entry["name"], entry)
        assert (offsets + header == entry["data_offset"] + entry["stride"] * np.arange(entry["rows"])).all()
    first = manifest["splits"]["train"]["shards"][0]
    with tarfile.open(small_shards / first["name"]) as archive:
        expected = np.stack([np.load(io.BytesIO(archive.extractfile(m).read())) for m in archive])

    def no_scan(*args, **kwargs):
        raise AssertionError("a reader opened the tar archive")

    monkeypatch.setattr(tarfile, "open", no_scan)
    dataset = ShardDataset(small_shards, verify="none")
    assert np.array_equal(dataset.read_rows(np.arange(first["rows"])), expected)
    assert dataset.read_rows(np.arange(len(dataset))).shape == (manifest["splits"]["train"]["rows"], SEQ_LEN + 1)


def test_plain_webdataset_reads_every_row(small_shards):
    """The pinned `webdataset` library reads our shards as they are: every row, in order, keyed by its row id (the
    member name without .npy), the same bytes as the loader's."""
    script = textwrap.dedent("""
        import glob, hashlib, sys, numpy as np, webdataset as wds
        urls = sorted(glob.glob(sys.argv[1] + "/train-*.tar"))
        digest, count = hashlib.sha256(), 0
        for sample in wds.WebDataset(urls, shardshuffle=False).decode():
            assert sample["npy"].dtype == np.uint16 and sample["__key__"] == f"{count:010d}", sample["__key__"]
            digest.update(sample["npy"].tobytes()); count += 1
        print(count, digest.hexdigest())
    """)
    out = subprocess.run([sys.executable, "-c", script, str(small_shards)], capture_output=True, text=True,
                         check=True, cwd=small_shards).stdout.split()
    rows = _all_rows(small_shards, "train")
    assert int(out[0]) == len(rows)
    assert out[1] == hashlib.sha256(rows.tobytes()).hexdigest()


def test_keep_last_partial_pads_only_the_final_row(small_corpus, chapters_tokenizer, tmp_path):
    options = ShardOptions(seq_len=500, shard_size=7, val_fraction=0.1, keep_last_partial=True, progress=False)
    manifest = prepare_shards(small_corpus, chapters_tokenizer.directory, tmp_path, options)
    for split in ("train", "val"):
        info = manifest["splits"][split]
        rows = _all_rows(tmp_path, split)
        assert info["dropped_tail_tokens"] == 0 and info["padded_tokens"] > 0
        assert info["stream_tokens"] + info["padded_tokens"] == rows.size
        assert (rows[-1, -info["padded_tokens"]:] == chapters_tokenizer.pad_id).all()
        assert (rows[:-1] != chapters_tokenizer.pad_id).all()


def test_existing_output_needs_overwrite(small_corpus, chapters_tokenizer, tmp_path):
    options = ShardOptions(seq_len=SEQ_LEN, shard_size=100000, val_fraction=0.0, progress=False)
    prepare_shards(small_corpus, chapters_tokenizer.directory, tmp_path, options)
    (tmp_path / "notes.txt").write_text("user file")
    with pytest.raises(DataPrepError, match="already holds shards.*--overwrite"):
        prepare_shards(small_corpus, chapters_tokenizer.directory, tmp_path, options)
    options.overwrite = True
    manifest = prepare_shards(small_corpus, chapters_tokenizer.directory, tmp_path, options)
    assert manifest["splits"]["val"]["rows"] == 0 and (tmp_path / "notes.txt").exists()
    assert json.loads((tmp_path / "manifest.json").read_text())["splits"]["train"]["rows"] > 0


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_members_are_exactly_numpy_save_and_tarfile_headers(dtype):
    row = np.arange(SEQ_LEN + 1, dtype=dtype)
    saved = io.BytesIO()
    np.save(saved, row)
    assert npy_header(dtype, SEQ_LEN + 1) + row.tobytes() == saved.getvalue()
    headers = MemberHeaders(len(saved.getvalue()))
    for r in (0, 7, 123456789):
        assert headers(member_name(r)) == tar_header(member_name(r), len(saved.getvalue()))
        info = tarfile.TarInfo.frombuf(headers(member_name(r)), "utf-8", "strict")
        assert (info.name, info.size, info.mtime, info.uid) == (member_name(r), len(saved.getvalue()), 0, 0)
