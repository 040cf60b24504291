"""Random access to the rows of a shard directory (no torch; used by the loader and by `inspect`).

The manifest records each shard's member layout (data_offset of row 0's array data, stride between rows; see
data_prep.shard_writer), so opening a shard reads no tar structure: the file is memory-mapped and its rows are one
strided numpy view, a batch one fancy-indexing copy. On first use every member's tar name and size field and its
.npy header are checked in one vectorised compare, and the rows must lie inside the file; errors name the shard and
the member. (Shards of a manifest without offsets are refused; `python -m data_prep reindex` scans them once.)
"""
from __future__ import annotations

import mmap
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import CorruptShardError, DataPrepError
from .manifest import check_tokenizer_hash, corrupt_shard_error
from .shard_writer import BLOCK, MEMBER_NAME_DIGITS, member_name, npy_header, tar_header

CORRUPT_POLICIES = ("error", "skip")
REMEDY = ("re-create the shards with `python -m data_prep shards`, or load with on_corrupt='skip' (a megaloop "
          "config: data.on_corrupt=skip) to leave this shard out (it is counted)")
NAME_FIELD, SIZE_FIELD = slice(0, 100), slice(124, 136)
STREAM_MAX_OPEN = 32  # memory maps a streamed dataset keeps open (its cache may delete the files of others)


@dataclass
class ShardIndex:
    """Where each row's array data starts inside one shard file: data_offset + i * stride."""

    name: str
    first_row: int  # the number its first member is named by: the manifest's member_first, else its first_row
    rows: int
    data_offset: int
    stride: int

    @property
    def data_offsets(self) -> np.ndarray:
        return self.data_offset + self.stride * np.arange(self.rows, dtype=np.int64)


def manifest_index(path: Path, entry: dict, row_len: int, dtype) -> tuple[ShardIndex, bytes]:
    """The index of one shard from its manifest entry, checked against the file's size (no read of the file).

    Returns the index and the .npy header every member must start with."""
    header = npy_header(dtype, row_len)
    row_bytes = row_len * np.dtype(dtype).itemsize
    offset, stride, rows = entry["data_offset"], entry["stride"], entry["rows"]
    if not all(isinstance(v, int) for v in (offset, stride)) or offset < BLOCK + len(header) \
            or (rows > 1 and stride < BLOCK + len(header) + row_bytes):
        raise CorruptShardError(entry["name"], f"the manifest's member layout (data_offset {offset!r}, stride "
                                f"{stride!r}) cannot hold rows of {row_bytes} bytes", REMEDY)
    file_size = path.stat().st_size
    fitting = 0 if offset + row_bytes > file_size else min(rows, (file_size - offset - row_bytes) // stride + 1)
    if fitting < rows:
        raise CorruptShardError(entry["name"], f"member data runs past the end of the file ({file_size} bytes; "
                                f"holds {fitting} of the {rows} rows the manifest records: truncated)", REMEDY,
                                member=member_name(member_first(entry) + fitting))
    return ShardIndex(entry["name"], member_first(entry), rows, offset, stride), header


def member_first(entry: dict) -> int:
    """The number a shard's first member is named by: its row in the split (format 2), or in its work unit
    (format 3's member_first: units are written apart and numbered on only in the manifest)."""
    return entry.get("member_first", entry["first_row"])


def _member_names(first_row: int, rows: int) -> np.ndarray:
    """The tar name fields ({row:010d}.npy, NUL-padded to 100 bytes) of `rows` members from `first_row`, [rows, 100]."""
    numbers = first_row + np.arange(rows, dtype=np.int64)
    powers = 10 ** np.arange(MEMBER_NAME_DIGITS - 1, -1, -1, dtype=np.int64)
    names = np.zeros((rows, 100), dtype=np.uint8)
    names[:, :MEMBER_NAME_DIGITS] = (numbers[:, None] // powers[None, :]) % 10 + ord("0")
    names[:, MEMBER_NAME_DIGITS:MEMBER_NAME_DIGITS + 4] = np.frombuffer(b".npy", dtype=np.uint8)
    return names


class ShardRows:
    """A memory-mapped shard: rows by local index."""

    def __init__(self, path: Path, entry: dict, row_len: int, dtype, vocab_size: int):
        self.name = entry["name"]
        self.row_len, self.dtype, self.vocab_size = row_len, np.dtype(dtype), vocab_size
        try:
            self.index, header = manifest_index(path, entry, row_len, dtype)
            with open(path, "rb") as handle:
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as exc:  # missing or unreadable: a corrupt shard set, with the same remedies
            raise CorruptShardError(self.name, f"cannot read the shard file: {exc.strerror or exc}", REMEDY) from None
        self._check_members(header)
        self._view = np.ndarray((self.index.rows, row_len), dtype=self.dtype, buffer=self._map,
                                offset=self.index.data_offset, strides=(self.index.stride, self.dtype.itemsize))

    def _check_members(self, header: bytes) -> None:
        """Every member's tar header names its row and records a row's size, and its data starts with the exact
        .npy header of a row (compared through one strided view of the mapping: no copy, no Python loop)."""
        index = self.index
        members = np.ndarray((index.rows, BLOCK + len(header)), dtype=np.uint8, buffer=self._map,
                             offset=index.data_offset - len(header) - BLOCK, strides=(index.stride, 1))
        size = len(header) + self.row_len * self.dtype.itemsize
        size_field = np.frombuffer(tar_header("x", size)[SIZE_FIELD], dtype=np.uint8)
        names, sizes = members[:, NAME_FIELD], members[:, SIZE_FIELD]
        bad_tar = ((names != _member_names(index.first_row, index.rows)).any(axis=1)
                   | (sizes != size_field[None, :]).any(axis=1))
        if bad_tar.any():
            self._raise_bad_member(int(np.nonzero(bad_tar)[0][0]), names, sizes, size, header)
        bad = np.nonzero((members[:, BLOCK:] != np.frombuffer(header, np.uint8)).any(axis=1))[0]
        if len(bad):
            raise CorruptShardError(self.name, "member does not hold a .npy row of the recorded dtype and length",
                                    REMEDY, member=member_name(self.index.first_row + int(bad[0])))

    def _raise_bad_member(self, i: int, names, sizes, expected_size: int, header: bytes):
        want = member_name(self.index.first_row + i)
        name = bytes(names[i]).split(b"\0", 1)[0].decode("utf-8", "replace")
        try:
            found = int(bytes(sizes[i]).strip(b"\0 ").decode("ascii") or "0", 8)
        except ValueError:
            found = -1
        problem = f"member is {name} of {found} bytes, expected {want} of {expected_size} bytes"
        tokens = (found - len(header)) / self.dtype.itemsize
        if name == want and found != expected_size and tokens.is_integer() and tokens > 1:
            problem += (f": it holds a row of {int(tokens)} tokens (seq_len {int(tokens) - 1}), but the manifest "
                        f"records seq_len {self.row_len - 1}, so the shards and manifest.json disagree")
        raise CorruptShardError(self.name, problem, REMEDY, member=want)

    def read(self, local_rows: np.ndarray) -> np.ndarray:
        """Rows [n, row_len] (a copy) for local row indices; ids beyond the vocabulary are a corruption error."""
        rows = self._view[local_rows]
        if rows.size and rows.max() >= self.vocab_size:
            bad = int(local_rows[int(np.nonzero((rows >= self.vocab_size).any(axis=1))[0][0])])
            raise CorruptShardError(self.name, f"row holds token ids >= vocab size {self.vocab_size}",
                                    "check the shards with `python -m data_prep inspect` (full checksums) and "
                                    "re-create them", member=member_name(self.index.first_row + bad))
        return rows


class ShardDataset:
    """Map-style access to the rows of one split: len(ds), ds[i] (a numpy row), ds.read_rows(indices).

    Row i is the i-th row among the shards in use (all of them unless on_corrupt='skip' left some out);
    `row_ids(indices)` gives their ids in the manifest's numbering (row_id = shard first_row + local row).
    """

    def __init__(self, shard_dir, split: str = "train", verify: str = "fast", on_corrupt: str = "error",
                 tokenizer_hash: str | None = None):
        from .sources import open_source

        if on_corrupt not in CORRUPT_POLICIES:
            raise DataPrepError(f"unknown on_corrupt policy {on_corrupt!r}", f"use one of {CORRUPT_POLICIES}")
        self.source = open_source(shard_dir)
        self.shard_dir = self.source.url
        self.manifest = self.source.manifest()
        if tokenizer_hash is not None:
            check_tokenizer_hash(self.manifest, tokenizer_hash)
        if split not in self.manifest["splits"]:
            raise DataPrepError(f"{shard_dir} has no split {split!r}", f"use one of {sorted(self.manifest['splits'])}")
        self.split, self.on_corrupt = split, on_corrupt
        self.seq_len, self.row_len = self.manifest["seq_len"], self.manifest["row_len"]
        self.dtype = np.dtype(self.manifest["dtype"])
        self.pad_id = self.manifest["tokenizer"]["pad_id"]
        self.skipped: list[dict] = []
        self.rows_read = 0  # rows copied out of the shards so far (read_rows)
        self.entries = self._usable_entries(verify)
        self._open: OrderedDict[int, ShardRows] = OrderedDict()
        self._substitute: dict[int, int] = {}  # streamed shards found corrupt under skip -> the shard read instead
        self.max_open = STREAM_MAX_OPEN if self.source.streams else None
        if on_corrupt == "skip" and not self.source.streams:
            self._index_all_or_skip()
        self._starts = np.cumsum([0] + [e["rows"] for e in self.entries]).astype(np.int64)

    def exclude(self, names, why: str) -> None:
        """Leave out the shards `names` too (counted in `skipped` with `why`): under on_corrupt='skip' the ranks of a
        job agree on one set of shards, so a shard one rank could not read is left out by every rank."""
        names = set(names) - {s["shard"] for s in self.skipped}
        if not names:
            return
        self.entries = [e for e in self.entries if e["name"] not in names]
        self.skipped += [{"shard": name, "problem": why} for name in sorted(names)]
        self._open.clear()  # shard numbers shift
        self._substitute.clear()
        self._starts = np.cumsum([0] + [e["rows"] for e in self.entries]).astype(np.int64)

    @property
    def shard_rows(self) -> np.ndarray:
        """Rows of each shard in use, in manifest order."""
        return np.diff(self._starts)

    def _usable_entries(self, verify: str) -> list[dict]:
        entries = self.manifest["splits"][self.split]["shards"]
        problems = self.source.verify(self.manifest, verify, [self.split])
        if problems and self.on_corrupt == "error":
            name = next(e["name"] for e in entries if e["name"] in problems)
            raise corrupt_shard_error(name, problems[name])
        self.skipped += [{"shard": name, "problem": problem} for name, problem in problems.items()]
        return [e for e in entries if e["name"] not in problems]

    def _index_all_or_skip(self) -> None:
        """Under on_corrupt='skip', index every shard now so the set of rows is fixed before any order is made."""
        kept = []
        for entry in self.entries:
            try:
                self._shard(len(kept), entry)
                kept.append(entry)
            except CorruptShardError as err:
                self._open.pop(len(kept), None)
                self.skipped.append({"shard": entry["name"], "problem": str(err)})
        self.entries = kept

    def _shard(self, number: int, entry: dict | None = None) -> ShardRows:
        if number in self._open:
            self._open.move_to_end(number)
            return self._open[number]
        entry = entry or self.entries[number]
        vocab = self.manifest["tokenizer"]["vocab_size"]
        for attempt in range(3):
            path = self.source.shard_path(entry)
            try:
                rows = ShardRows(path, entry, self.row_len, self.dtype, vocab)
                break
            except CorruptShardError:
                if self.source.streams and attempt == 0 and path.exists():
                    # a damaged local copy of a verified download (the node's disk): fetched again, so that only
                    # the store's bytes, the same for every rank, can make a streamed shard corrupt
                    path.unlink(missing_ok=True)
                    continue
                if path.exists() or attempt == 2:  # else: evicted by another rank between fetch and open
                    raise
        self._open[number] = rows
        if self.max_open is not None and len(self._open) > self.max_open:
            self._open.popitem(last=False)
        return rows

    def _readable(self, number: int) -> int:
        """The shard whose rows stand for shard `number`: itself, or under on_corrupt='skip' on a streamed source
        the next readable shard (in manifest order) when it is corrupt or missing. The verdict depends only on the
        stored bytes against the manifest's checksum, so every rank that touches the shard takes the same one."""
        if number in self._substitute:
            return self._substitute[number]
        if not (self.on_corrupt == "skip" and self.source.streams):
            self._shard(number)
            return number
        for step in range(len(self.entries)):
            candidate = (number + step) % len(self.entries)
            try:
                self._shard(candidate)
                if candidate != number:
                    self._substitute[number] = candidate
                return candidate
            except CorruptShardError as err:
                if not any(s["shard"] == err.shard for s in self.skipped):
                    self.skipped.append({"shard": err.shard, "problem": str(err)})
        raise CorruptShardError(self.entries[number]["name"], "no shard of the split is readable", REMEDY)

    def prefetch_rows(self, indices: np.ndarray) -> None:
        """Start fetching the shards of these rows in the background (a streamed source; else nothing)."""
        if self.source.streams and len(indices):
            shard, _ = self.locate(indices)
            self.source.prefetch([self.entries[int(n)] for n in np.unique(shard) if int(n) not in self._open])

    def close(self) -> None:
        """Forget the open memory maps (they are unmapped once no array refers to them); reopened on demand."""
        self._open.clear()

    def close_source(self) -> None:
        """close() and stop the source's background downloads."""
        self.close()
        self.source.close()

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index: int) -> np.ndarray:
        return self.read_rows(np.array([index]))[0]

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard number, local row) for dataset indices."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"row indices must lie in [0, {len(self)})")
        shard = np.searchsorted(self._starts, indices, side="right") - 1
        return shard, indices - self._starts[shard]

    def row_ids(self, indices: np.ndarray) -> np.ndarray:
        """Manifest row ids (stable even when shards were skipped) of dataset indices: of the rows read instead,
        for a streamed shard replaced under on_corrupt='skip'."""
        shard, local = self.locate(indices)
        shard, local = self._substituted(shard, local)
        firsts = np.asarray([e["first_row"] for e in self.entries], dtype=np.int64)
        return firsts[shard] + local

    def _substituted(self, shard: np.ndarray, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if not self._substitute:
            return shard, local
        shard, local = shard.copy(), local.copy()
        rows = self.shard_rows
        for bad, good in self._substitute.items():
            where = shard == bad
            shard[where], local[where] = good, local[where] % rows[good]
        return shard, local

    def read_rows(self, indices: np.ndarray) -> np.ndarray:
        """Rows [len(indices), row_len] in the given order (one copy per shard touched)."""
        shard, local = self.locate(indices)
        for number in np.unique(shard):
            self._readable(int(number))
        shard, local = self._substituted(shard, local)
        self.rows_read += len(shard)
        out = np.empty((len(shard), self.row_len), dtype=self.dtype)
        for number in np.unique(shard):
            where = np.nonzero(shard == number)[0]
            out[where] = self._shard(int(number)).read(local[where])
        return out
