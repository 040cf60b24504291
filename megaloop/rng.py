"""Counter-based randomness keyed by (seed, step, global sample index, stream).

Every random quantity of a training step that belongs to one sequence (its loop depth, its initial state h_0) is
a pure function of this key, so it is the same whatever the rank, the micro-batch or the parallel layout that
happens to process the sequence. The mixing is SplitMix64, vectorised over sample indices with numpy uint64
arithmetic (wrap-around is the intended modular arithmetic), the same finaliser that keys the data order.
`name_seed` keys a stream by a name instead (a parameter's initialisation).
"""
from __future__ import annotations

import hashlib

import numpy as np

from data_prep.order import splitmix64 as _splitmix64

# One stream id per kind of random quantity, so that two quantities of one sample are independent.
STREAM_DEPTH = 1
STREAM_H0 = 2
STREAM_BATCH_DEPTH = 3
# Second uniform of a per-sequence lognormal depth draw (its rate tau); high bits keep it clear of the ids above.
STREAM_DEPTH_TAU = (1 << 32) | STREAM_DEPTH

_MASK63 = np.uint64((1 << 63) - 1)


def key_hash(seed: int, step: int, index, stream: int) -> np.ndarray:
    """64-bit hashes of (seed, step, index, stream); `index` is an int or an integer array of sample indices."""
    idx = np.asarray(index, dtype=np.int64).astype(np.uint64)
    with np.errstate(over="ignore"):
        h = _splitmix64(np.full(idx.shape, int(seed) & 0xFFFFFFFFFFFFFFFF, dtype=np.uint64))
        h = _splitmix64(h ^ np.uint64(int(step) & 0xFFFFFFFFFFFFFFFF))
        h = _splitmix64(h ^ np.uint64(int(stream) & 0xFFFFFFFFFFFFFFFF))
        h = _splitmix64(h ^ idx)
    return h


def key_uniform(seed: int, step: int, index, stream: int) -> np.ndarray:
    """Uniform float64 in the open interval (0, 1), one per index, a pure function of the key."""
    h = key_hash(seed, step, index, stream)
    return ((h >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)


def key_seeds(seed: int, step: int, index, stream: int) -> np.ndarray:
    """Non-negative 63-bit integer seeds (for torch.Generator.manual_seed), one per index."""
    return (key_hash(seed, step, index, stream) & _MASK63).astype(np.int64)


def name_seed(seed: int, name: str) -> int:
    """A non-negative 63-bit seed keyed by (seed, name), e.g. a parameter's qualified name: BLAKE2b of the UTF-8
    name mixed with the seed through SplitMix64, so it is stable across processes and Python versions (unlike
    hash(), which is salted per process)."""
    digest = int.from_bytes(hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest(), "little")
    with np.errstate(over="ignore"):
        h = _splitmix64(np.array([int(seed) & 0xFFFFFFFFFFFFFFFF], dtype=np.uint64))
        h = _splitmix64(h ^ np.uint64(digest))
    return int(h[0] & _MASK63)
