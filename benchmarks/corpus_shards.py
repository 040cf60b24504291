"""Shards for the training benchmarks, built with data_prep's own API from a folder of plain-text documents: the
files of --corpus, else the shared corpus's chapters beside the checkout (MEGALOOP_SHARED overrides where), else the
bundled data/sample_corpus. The defaults are those of the tests' tiny_shards fixture (first 24 chapters, vocab 512,
32-token rows)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def corpus_files(corpus: str | None, chapters: int | None = 24) -> list[Path]:
    """The documents to build shards from: --corpus's .txt files, else the shared corpus's first `chapters` chapters
    (None: all), else the bundled sample corpus."""
    if corpus is not None:
        files = sorted(Path(corpus).glob("*.txt"))
        if not files:
            raise SystemExit(f"--corpus {corpus}: no .txt files there; pass a folder of plain-text documents")
        return files
    shared = Path(os.environ.get("MEGALOOP_SHARED", REPO.parent / "shared"))
    found = sorted((shared / "data" / "corpus" / "chapters").glob("*.txt"))[:chapters]
    return found or sorted((REPO / "data" / "sample_corpus").glob("*.txt"))


def build_shards(files: list[Path], root: Path, vocab: int = 512, seq_len: int = 32, val_fraction: float = 0.1,
                 shard_size: int = 256) -> Path:
    """A tokenizer of `vocab` trained on `files` and their shards of `seq_len`-token rows, under root; returns the
    shard folder."""
    from data_prep.prepare import ShardOptions, prepare_shards
    from data_prep.tokenizer import train_tokenizer

    corpus = root / "corpus"
    corpus.mkdir(parents=True)
    for f in files:
        shutil.copy(f, corpus / f.name)
    train_tokenizer(corpus, root / "tok", vocab_size=vocab, progress=False)
    prepare_shards(corpus, root / "tok", root / "shards",
                   ShardOptions(seq_len=seq_len, val_fraction=val_fraction, shard_size=shard_size, progress=False))
    return root / "shards"
