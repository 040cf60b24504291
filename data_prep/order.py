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
