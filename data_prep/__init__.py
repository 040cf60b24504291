"""data_prep: tokenizer training, text -> packed webdataset shards (+ manifest), and the streaming loader.

This package never imports `megaloop`. Importing it is cheap: torch is only imported by the loader.

    python -m data_prep tokenizer --input TEXT_DIR --output TOK_DIR --vocab-size 32768
    python -m data_prep shards --input TEXT_DIR --tokenizer TOK_DIR --output SHARD_DIR --seq-len 2048
    python -m data_prep inspect SHARD_DIR
    python -m data_prep upload SHARD_DIR s3://bucket/prefix     (then train with data.shards=s3://bucket/prefix)

Public API (see each module): `train_tokenizer`, `load_tokenizer` (data_prep.tokenizer), `prepare_shards`
(data_prep.prepare), `ShardLoader`, `ShardDataset`, `validation_batches` (data_prep.loader); shards from S3 or HTTP
through a node cache: data_prep.sources (ShardSource), data_prep.stores (ByteStore), data_prep.node_cache.
"""
from __future__ import annotations

__version__ = "1.0"

_LAZY = {
    "train_tokenizer": "tokenizer", "load_tokenizer": "tokenizer", "prepare_shards": "prepare",
    "ShardLoader": "loader", "ShardDataset": "loader", "validation_batches": "loader",
}


def __getattr__(name):
    """Import the public names on first use, so that `import data_prep` stays light."""
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
