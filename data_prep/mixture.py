"""Several corpora in one stream, with weights (megaloop's data.shards as a list, data.mix the weights).

Every global batch of G rows holds a fixed number of rows of each corpus: quota_c = round(w_c x G) by largest
remainder (ties to the earlier corpus), so the quotas add up to G. Global batch s permutes its G slots with a
RowPermutation keyed by (seed, s); slot q belongs to the corpus whose quota range holds q, at rank r inside it. That
row is corpus c's stream position s x quota_c + r, read in corpus c's own order (global or blocks, over its own rows
and epochs). So the stream stays a pure function of (seed, position) for a fixed G: the loader's state (the global
position), resume under any dp and the dealing of rows to ranks are unchanged. Each corpus advances exactly by its
quota per step, whatever happened before.

MixedDataset puts the corpora's rows in one index space (corpus c's row i is offset_c + i) and their manifest row ids
in one too (corpus c's id j is base_c + j, base_c the rows of the manifests before it).
"""
from __future__ import annotations

import hashlib
import json

import numpy as np

from .errors import DataPrepError
from .manifest import manifest_fingerprint
from .order import RowPermutation, make_order, splitmix64
from .shard_reader import ShardDataset

_MIX_TAG = np.uint64(0x5EED0F417)


def mix_quotas(weights, global_batch_size: int) -> np.ndarray:
    """Rows of each corpus per global batch: round(w x G) by largest remainder, summing to G."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or (w < 0).any() or not w.sum() > 0:
        raise DataPrepError(f"mix weights {list(weights)} are not non-negative numbers with a positive sum",
                            "give one weight >= 0 per corpus, e.g. data.mix=[0.7,0.3]")
    exact = w / w.sum() * global_batch_size
    quotas = np.floor(exact).astype(np.int64)
    short = global_batch_size - int(quotas.sum())
    quotas[np.argsort(-(exact - quotas), kind="stable")[:short]] += 1
    return quotas


class MixedDataset:
    """The rows of several ShardDatasets in one index space (the parts of ShardDataset's interface the loader uses)."""

    def __init__(self, parts: list[ShardDataset]):
        if len({(p.row_len, p.dtype.str) for p in parts}) != 1:
            raise DataPrepError("the corpora of a mix hold rows of different lengths or dtypes "
                                f"({[(p.shard_dir, p.row_len, p.dtype.name) for p in parts]})",
                                "mix shards made with the same --seq-len and tokenizer")
        self.parts = parts
        self.row_len, self.dtype = parts[0].row_len, parts[0].dtype
        self.offsets = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
        bases = [sum(p.manifest["splits"][p.split]["rows"] for p in parts[:i]) for i in range(len(parts))]
        self.bases = np.asarray(bases, dtype=np.int64)
        self.source = _Sources([p.source for p in parts])
        key = [manifest_fingerprint(p.manifest) for p in parts]
        self.fingerprint = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def skipped(self) -> list[dict]:
        return [s for p in self.parts for s in p.skipped]

    @property
    def rows_read(self) -> int:
        return sum(p.rows_read for p in self.parts)

    def _split(self, indices: np.ndarray):
        indices = np.asarray(indices, dtype=np.int64)
        corpus = np.searchsorted(self.offsets, indices, side="right") - 1
        return corpus, indices - self.offsets[corpus]

    def read_rows(self, indices: np.ndarray) -> np.ndarray:
        corpus, local = self._split(indices)
        out = np.empty((len(local), self.row_len), dtype=self.dtype)
        for c in np.unique(corpus):
            where = np.nonzero(corpus == c)[0]
            out[where] = self.parts[int(c)].read_rows(local[where])
        return out

    def row_ids(self, indices: np.ndarray) -> np.ndarray:
        corpus, local = self._split(indices)
        ids = np.empty(len(local), dtype=np.int64)
        for c in np.unique(corpus):
            where = np.nonzero(corpus == c)[0]
            ids[where] = self.bases[int(c)] + self.parts[int(c)].row_ids(local[where])
        return ids

    def prefetch_rows(self, indices: np.ndarray) -> None:
        corpus, local = self._split(indices)
        for c in np.unique(corpus):
            self.parts[int(c)].prefetch_rows(local[corpus == c])

    def close(self) -> None:
        for p in self.parts:
            p.close()

    def close_source(self) -> None:
        for p in self.parts:
            p.close_source()


class _Sources:
    """What the loader asks of its dataset's source, over the corpora's sources."""

    def __init__(self, sources):
        self.sources = sources
        self.streams = any(s.streams for s in sources)

    def stats(self) -> dict:
        each = [s.stats() for s in self.sources]
        total = {k: sum(e[k] for e in each) for k in ("bytes_downloaded", "downloads", "hits", "retries", "evicted")}
        asked = total["hits"] + total["downloads"]
        return {**total, "hit_ratio": total["hits"] / asked if asked else 1.0}


class MixOrder:
    """Stream position -> (row of the MixedDataset, the epoch of its corpus); see the module docstring."""

    def __init__(self, dataset: MixedDataset, weights, global_batch_size: int, seed: int, kind: str,
                 block_shards: int):
        self.dataset, self.global_batch_size = dataset, global_batch_size
        self.quotas = mix_quotas(weights, global_batch_size)
        self.starts = np.concatenate([[0], np.cumsum(self.quotas)]).astype(np.int64)
        self.orders = [make_order(kind, p.shard_rows, seed, block_shards) for p in dataset.parts]
        self.seed = int(splitmix64(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64) ^ _MIX_TAG)[0])
        self.tag = self.orders[0].tag + "/mix" + ",".join(map(str, self.quotas.tolist()))

    def rows_at(self, positions) -> tuple[np.ndarray, np.ndarray]:
        positions = np.asarray(positions, dtype=np.int64)
        g = self.global_batch_size
        steps, slots = positions // g, positions % g
        permuted = np.empty_like(slots)
        for s in np.unique(steps):
            where = steps == s
            permuted[where] = RowPermutation(g, self.seed, int(s))(slots[where])
        corpus = np.searchsorted(self.starts, permuted, side="right") - 1
        rows, epochs = np.empty_like(positions), np.empty_like(positions)
        for c in np.unique(corpus):
            where = corpus == c
            inner = steps[where] * self.quotas[c] + permuted[where] - self.starts[c]
            r, e = self.orders[int(c)].rows_at(inner)
            rows[where], epochs[where] = self.dataset.offsets[int(c)] + r, e
        return rows, epochs
