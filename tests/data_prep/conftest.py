"""Shared fixtures of the data_prep tests: small real corpora, a small tokenizer, small shard directories.

Everything is built once per session in temporary directories, from ../shared/data/corpus (via `shared_dir`).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dp_testing import ROWS_PER_SHARD, SEQ_LEN, SMALL_CORPUS_FILES, TOKENIZER_VOCAB


@pytest.fixture(scope="session")
def chapters_dir(shared_dir) -> Path:
    """The 222 chapter files (4.6 MB)."""
    return shared_dir / "data" / "corpus" / "chapters"


@pytest.fixture(scope="session")
def small_corpus(chapters_dir, tmp_path_factory) -> Path:
    """A copy of the first 24 chapter files (~0.8 MB), plus one novel excerpt with a BOM and CRLF line ends."""
    out = tmp_path_factory.mktemp("small_corpus")
    for path in sorted(chapters_dir.glob("*.txt"))[:SMALL_CORPUS_FILES]:
        shutil.copyfile(path, out / path.name)
    novel = sorted((chapters_dir.parent / "novels").glob("*.txt"))[0].read_bytes()
    assert novel.startswith(b"\xef\xbb\xbf") and b"\r\n" in novel[:20000]
    (out / "novel_excerpt.txt").write_bytes(novel[:20000].rsplit(b"\r\n", 1)[0] + b"\r\n")
    return out


@pytest.fixture(scope="session")
def chapters_tokenizer(chapters_dir, tmp_path_factory):
    """A byte-level BPE with vocab 4096 trained on all chapters."""
    from data_prep.tokenizer import train_tokenizer

    return train_tokenizer(chapters_dir, tmp_path_factory.mktemp("tok4096"), vocab_size=TOKENIZER_VOCAB,
                           progress=False)


@pytest.fixture(scope="session")
def small_shards(small_corpus, chapters_tokenizer, tmp_path_factory) -> Path:
    """Shards of the small corpus: seq_len 64, 300 rows per shard, 10% of documents held out."""
    from data_prep.prepare import ShardOptions, prepare_shards

    out = tmp_path_factory.mktemp("small_shards")
    prepare_shards(small_corpus, chapters_tokenizer.directory, out,
                   ShardOptions(seq_len=SEQ_LEN, shard_size=ROWS_PER_SHARD, val_fraction=0.1, progress=False))
    return out


@pytest.fixture
def shard_copy(small_shards, tmp_path) -> Path:
    """A private copy of the small shards that a test may damage."""
    out = tmp_path / "shards"
    shutil.copytree(small_shards, out)
    return out
