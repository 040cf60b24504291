"""What model.doc_mask needs from the data, read from a shard directory's manifest when the config is validated
(megaloop.config.tree): the BOS id that starts each document, the assurance that documents were framed with it, and
the share of attention document masking keeps, for the FLOP model.

Manifests: tokenizer.bos_id is the BOS id (missing or null: a tokenizer without BOS). The `packing` record
(data_prep/packing.py) says with `bos_framed` whether documents were framed BOS text EOS; a manifest without it
was written by the stream packer before packing was recorded, which frames every document so, i.e. it is
BOS-framed exactly when its tokenizer has a BOS.
"""
from __future__ import annotations

from pathlib import Path

SAMPLE_ROWS = 256  # rows read, evenly spaced over the train split, to measure the attention share


def manifest_bos_id(info: dict) -> int | None:
    """The tokenizer's BOS id recorded in a manifest, or None."""
    tok = info.get("tokenizer")
    bos = tok.get("bos_id") if isinstance(tok, dict) else None
    return bos if isinstance(bos, int) and not isinstance(bos, bool) else None


def frames_documents_with_bos(info: dict) -> bool:
    """Whether the manifest's documents start with the BOS token: its packing record's bos_framed, or (no record,
    or a record without that field: the stream packer of before) whether its tokenizer has a BOS."""
    packing = info.get("packing")
    if isinstance(packing, dict) and "bos_framed" in packing:
        return packing["bos_framed"] is True and manifest_bos_id(info) is not None
    return manifest_bos_id(info) is not None


def measured_attention_share(corpora: list, weights: list[float] | None, seq_len: int, bos_id: int,
                             rows: int = SAMPLE_ROWS) -> float:
    """The mean over rows of sum_d len_d^2 / seq_len^2 (megaloop.model.documents.attention_share) of local shard
    directories `corpora`, from up to `rows` rows of each train split evenly spaced, averaged with `weights` (each
    corpus's share of the batches, data.mix; None: in proportion to their train rows)."""
    measured = [_corpus_share(Path(one), seq_len, bos_id, rows) for one in corpora]
    weights = [count for _, count in measured] if weights is None else weights
    if not sum(weights) > 0:
        return 1.0
    return sum(w * share for w, (share, _) in zip(weights, measured)) / sum(weights)


def _corpus_share(shards: Path, seq_len: int, bos_id: int, rows: int) -> tuple[float, int]:
    """(the attention share of the sampled train rows, the train rows) of one shard directory."""
    import numpy as np

    from data_prep.shard_reader import ShardDataset
    from megaloop.model.documents import attention_share

    data = ShardDataset(shards, "train", verify="fast")
    try:
        if len(data) == 0:
            return 1.0, 0
        picks = np.unique(np.linspace(0, len(data) - 1, min(rows, len(data))).astype(np.int64))
        return attention_share(data.read_rows(picks)[:, :seq_len].astype(np.int64), bos_id), len(data)
    finally:
        data.close()
