"""Reference points for a validation loss: the uniform and the unigram (context-free) cross-entropy of a split.

A language model that has learned anything beyond token frequencies must go below the unigram entropy of the data
it is evaluated on; that is the threshold the convergence checks use.
"""
from __future__ import annotations

import math

import numpy as np


def unigram_entropy(shard_dir, split: str = "train", fit_split: str | None = None) -> float:
    """Cross-entropy in nats of `split` under the unigram distribution of `fit_split` (default: the same split,
    i.e. its entropy), add-one smoothed over the vocabulary. Every token of every row is counted once
    (rows overlap by one token, which changes nothing measurable)."""
    from data_prep.shard_reader import ShardDataset

    fit = _token_counts(ShardDataset(shard_dir, fit_split or split, verify="none"))
    vocab = len(fit)
    probs = (fit + 1.0) / (fit.sum() + vocab)
    counts = fit if fit_split in (None, split) else _token_counts(ShardDataset(shard_dir, split, verify="none"),
                                                                  vocab)
    return float(-(counts * np.log(probs)).sum() / counts.sum())


def _token_counts(ds, vocab: int | None = None) -> np.ndarray:
    vocab = vocab or int(ds.manifest["tokenizer"]["vocab_size"])
    counts = np.zeros(vocab, dtype=np.float64)
    for start in range(0, len(ds), 4096):
        rows = ds.read_rows(np.arange(start, min(start + 4096, len(ds)), dtype=np.int64))
        counts += np.bincount(rows.reshape(-1), minlength=vocab)[:vocab]
    return counts


def uniform_entropy(vocab_size: int) -> float:
    return math.log(vocab_size)
