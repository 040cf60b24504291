"""Shards of two bundled novels for the GPU checks (no shared data is needed on the GPU machine)."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def novel_shards(root: Path, vocab_size: int, seq_len: int) -> Path:
    """A tokenizer of `vocab_size` and shards of seq_len + 1-token rows from two bundled novels, under `root`."""
    from data_prep.prepare import ShardOptions, prepare_shards
    from data_prep.tokenizer import train_tokenizer

    corpus = root / "corpus"
    corpus.mkdir()
    for name in ("Doyle_Lost_1912.txt", "Kipling_Light_1891.txt"):
        (corpus / name).write_bytes((REPO / "data" / "sample_corpus" / name).read_bytes())
    train_tokenizer(corpus, root / "tok", vocab_size=vocab_size)
    prepare_shards(corpus, root / "tok", root / "shards",
                   ShardOptions(seq_len=seq_len, val_fraction=0.1, progress=False))
    return root / "shards"
