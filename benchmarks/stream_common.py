"""Shared set-up of the streaming benchmarks (benchmarks/stream_*.py): a shard directory built from the chapters
corpus, served from moto's S3 and a local HTTP server on 127.0.0.1."""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHARED = Path(os.environ.get("MEGALOOP_SHARED", REPO.parent / "shared"))


def chapters_dir() -> Path:
    """The chapters corpus in the shared data folder beside the checkout (MEGALOOP_SHARED overrides where)."""
    found = SHARED / "data" / "corpus" / "chapters"
    if not found.is_dir():
        raise SystemExit(f"error: no chapters corpus at {found}; set MEGALOOP_SHARED to the shared folder")
    return found


def build_shards(root: Path, files: int = 24, seq_len: int = 32, shard_size: int = 256, vocab: int = 512) -> Path:
    """Shards of the first `files` chapters (the suite's tiny_shards for the defaults)."""
    from data_prep.prepare import ShardOptions, prepare_shards
    from data_prep.tokenizer import train_tokenizer

    corpus = root / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    for f in sorted(chapters_dir().glob("*.txt"))[:files]:
        shutil.copy(f, corpus / f.name)
    train_tokenizer(corpus, root / "tok", vocab_size=vocab, progress=False)
    prepare_shards(corpus, root / "tok", root / "shards",
                   ShardOptions(seq_len=seq_len, val_fraction=0.1, shard_size=shard_size, progress=False))
    return root / "shards"
