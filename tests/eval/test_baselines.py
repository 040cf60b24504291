"""The unigram threshold equals a direct count over the rows."""
import math

import numpy as np

from megaloop.eval.baselines import unigram_entropy, uniform_entropy


def test_unigram_entropy_matches_direct_count(tiny_shards):
    from data_prep.shard_reader import ShardDataset

    ds = ShardDataset(tiny_shards, "train", verify="none")
    rows = np.stack([ds[i] for i in range(len(ds))])
    vocab = int(ds.manifest["tokenizer"]["vocab_size"])
    counts = np.bincount(rows.reshape(-1), minlength=vocab).astype(float)
    p = (counts + 1) / (counts.sum() + vocab)
    expected = -(counts * np.log(p)).sum() / counts.sum()
    got = unigram_entropy(tiny_shards, "train")
    assert abs(got - expected) < 1e-9
    assert 0 < got < uniform_entropy(vocab) == math.log(vocab)
    assert unigram_entropy(tiny_shards, "val", fit_split="train") > 0
