"""The data the training paths read: a synthetic corpus (seeded words), a byte-level BPE of 512 tokens and 32-token
shards, made with data_prep's own commands in well under a second."""
from __future__ import annotations

import random
from pathlib import Path

SEQ_LEN = 32
VOCAB = 512


def make_corpus(folder: Path, documents: int = 16, words_per_document: int = 3000) -> None:
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 8))) for _ in range(300)]
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(documents):
        (folder / f"doc{i}.txt").write_text(" ".join(rng.choice(words) for _ in range(words_per_document)))


def make_shards(root: Path) -> Path:
    """root/shards (tokenizer in root/tokenizer), made afresh; returns the shard directory."""
    from data_prep.prepare import ShardOptions, prepare_shards
    from data_prep.tokenizer import train_tokenizer

    make_corpus(root / "corpus")
    train_tokenizer(root / "corpus", root / "tokenizer", vocab_size=VOCAB, overwrite=True, progress=False)
    prepare_shards(root / "corpus", root / "tokenizer", root / "shards",
                   ShardOptions(seq_len=SEQ_LEN, val_fraction=0.2, shard_size=256, overwrite=True, progress=False))
    return root / "shards"
