"""The global sample order: a pseudo-random permutation of all rows per epoch, computed on the fly.

Epoch e visits the N rows in the order perm_{seed,e}(0), perm_{seed,e}(1), ..., perm_{seed,e}(N-1). The permutation
is a balanced Feistel network on 2k-bit integers (2^2k >= N, six rounds keyed by SplitMix64 of (seed, epoch,
round)), restricted to [0, N) by cycle walking (re-encrypt while the value is >= N; each value is a bijection's
image, so the walk ends and the restriction is itself a bijection). Any position is computed in O(1) without
storing an N-element array, which keeps resume instant and memory flat for billions of rows.

The run is one endless stream: stream position p belongs to epoch p // N and reads row perm_{seed, p // N}(p % N).
Global batch s holds positions [s*G, (s+1)*G). Nothing here depends on the number of data-parallel ranks.
"""
from __future__ import annotations

import numpy as np

FEISTEL_ROUNDS = 6
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def splitmix64(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser, vectorised over uint64 (wrap-around arithmetic is intended)."""
    z = values + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def round_keys(seed: int, epoch: int, rounds: int = FEISTEL_ROUNDS) -> np.ndarray:
    """One 64-bit key per Feistel round, a function of (seed, epoch) only."""
    base = splitmix64(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
    base = splitmix64(base ^ np.uint64(epoch & 0xFFFFFFFFFFFFFFFF))
    return splitmix64(base ^ np.arange(1, rounds + 1, dtype=np.uint64))


class RowPermutation:
    """A bijection of [0, n) keyed by (seed, epoch); call it on an int64 array of positions."""

    def __init__(self, n: int, seed: int, epoch: int):
        if n < 1:
            raise ValueError(f"cannot permute {n} rows")
        self.n = n
        bits = max(2, int(n - 1).bit_length())
        self.half_bits = (bits + 1) // 2
        self.mask = np.uint64((1 << self.half_bits) - 1)
        self.keys = round_keys(seed, epoch)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        shift = np.uint64(self.half_bits)
        left, right = x >> shift, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (splitmix64(right ^ key) & self.mask)
        return (left << shift) | right

    def __call__(self, positions) -> np.ndarray:
        """perm(positions) for positions in [0, n), as int64."""
        x = np.asarray(positions, dtype=np.int64)
        if x.size and (x.min() < 0 or x.max() >= self.n):
            raise ValueError(f"positions must lie in [0, {self.n})")
        with np.errstate(over="ignore"):
            y = self._encrypt(x.astype(np.uint64))
            outside = y >= np.uint64(self.n)
            while outside.any():
                y[outside] = self._encrypt(y[outside])
                outside = y >= np.uint64(self.n)
        return y.astype(np.int64)


def rows_at(stream_positions: np.ndarray, n_rows: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, epoch) for each stream position: epoch = p // n_rows, row = perm_{seed, epoch}(p % n_rows)."""
    positions = np.asarray(stream_positions, dtype=np.int64)
    epochs = positions // n_rows
    rows = np.empty_like(positions)
    for epoch in np.unique(epochs):
        where = epochs == epoch
        rows[where] = RowPermutation(n_rows, seed, int(epoch))(positions[where] % n_rows)
    return rows, epochs


def rank_slice(global_batch: int, dp_rank: int, dp_size: int) -> tuple[int, int]:
    """[start, end) of rank `dp_rank`'s contiguous share of a global batch."""
    share = global_batch // dp_size
    return dp_rank * share, (dp_rank + 1) * share


ORDERS = ("global", "blocks")
_BLOCK_TAG = np.uint64(0xB10C5EED)


class GlobalOrder:
    """Today's order: a full permutation of the N rows per epoch (rows_at above)."""

    def __init__(self, n_rows: int, seed: int):
        self.n, self.seed = n_rows, seed

    def rows_at(self, positions) -> tuple[np.ndarray, np.ndarray]:
        return rows_at(positions, self.n, self.seed)

    @property
    def tag(self) -> str:
        return ""


class BlockOrder:
    """A block-local order for streamed shards: still one permutation of all rows per epoch, a pure function of
    (seed, position), but one that touches few shards at a time.

    Epoch e permutes the S shards (a RowPermutation of [0, S) keyed by a seed derived from `seed`, and e), cuts the
    permuted list into blocks of W consecutive shards, and visits the blocks in that order; inside block b the rows
    of its W shards are visited in a RowPermutation keyed by (seed, e, b). A global batch of G rows therefore
    touches the W shards of one block (two at a block's end), and a loader downloads a block's shards once instead
    of every shard for every batch. Each epoch still visits every row exactly once."""

    def __init__(self, shard_rows, seed: int, block_shards: int):
        if block_shards < 1:
            raise ValueError(f"block_shards must be >= 1, got {block_shards}")
        self.shard_rows = np.asarray(shard_rows, dtype=np.int64)
        self.shard_starts = np.concatenate([[0], np.cumsum(self.shard_rows)]).astype(np.int64)
        self.n, self.seed, self.block_shards = int(self.shard_starts[-1]), seed, block_shards
        self.block_seed = int(splitmix64(np.array([seed & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64) ^ _BLOCK_TAG)[0])
        self._epochs: dict[int, tuple] = {}

    @property
    def tag(self) -> str:
        return f"/blocks{self.block_shards}"

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, int]:
        """(shard order, start of each block in the epoch's positions, number of blocks), cached for two epochs."""
        if epoch not in self._epochs:
            shards = len(self.shard_rows)
            order = RowPermutation(shards, self.block_seed, epoch)(np.arange(shards, dtype=np.int64))
            n_blocks = -(-shards // self.block_shards)
            block_of = np.arange(shards) // self.block_shards
            block_rows = np.bincount(block_of, weights=self.shard_rows[order], minlength=n_blocks).astype(np.int64)
            starts = np.concatenate([[0], np.cumsum(block_rows)]).astype(np.int64)
            if len(self._epochs) >= 2:
                self._epochs.pop(next(iter(self._epochs)))
            self._epochs[epoch] = (order, starts, n_blocks)
        return self._epochs[epoch]

    def rows_at(self, positions) -> tuple[np.ndarray, np.ndarray]:
        """(dataset row, epoch) for each stream position."""
        positions = np.asarray(positions, dtype=np.int64)
        epochs = positions // self.n
        rows = np.empty_like(positions)
        for epoch in np.unique(epochs):
            where = np.nonzero(epochs == epoch)[0]
            order, starts, n_blocks = self._epoch(int(epoch))
            offset = positions[where] % self.n
            block = np.searchsorted(starts, offset, side="right") - 1
            for b in np.unique(block):
                inside = block == b
                size = int(starts[b + 1] - starts[b])
                key = int(epoch) * n_blocks + int(b)
                local = RowPermutation(size, self.seed, key)(offset[inside] - starts[b])
                shards = order[b * self.block_shards:(b + 1) * self.block_shards]
                cumulative = np.concatenate([[0], np.cumsum(self.shard_rows[shards])])
                k = np.searchsorted(cumulative, local, side="right") - 1
                rows[where[inside]] = self.shard_starts[shards[k]] + local - cumulative[k]
        return rows, epochs


def make_order(kind: str, shard_rows, seed: int, block_shards: int = 8):
    """The sample order `kind` (global | blocks) over shards of these row counts."""
    if kind == "global":
        return GlobalOrder(int(np.sum(shard_rows)), seed)
    if kind == "blocks":
        return BlockOrder(shard_rows, seed, block_shards)
    raise ValueError(f"unknown order {kind!r}; use one of {ORDERS}")


def mixing(row_ids: np.ndarray, n_rows: int) -> float:
    """Mean distance in the corpus (manifest row ids) between two rows of one batch, over its expectation for
    independent uniform rows (N/3): about 1.0 for a full permutation; a block-local order draws its W shards at
    random from the whole corpus, so only pairs from the same shard are close (about 1 - 1/W)."""
    ids = np.sort(np.asarray(row_ids, dtype=np.float64))
    m = len(ids)
    if m < 2:
        return float("nan")
    # sum over pairs i<j of (ids[j] - ids[i]) = sum_k ids[k] * (2k - m + 1)
    total = float(np.sum(ids * (2 * np.arange(m) - m + 1)))
    return total / (m * (m - 1) / 2) / (n_rows / 3)
