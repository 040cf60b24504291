"""Random access to the rows of a shard directory (no torch; used by the loader and by `inspect`).

Each shard is indexed once, on first use: tarfile walks the member headers and gives every member's data offset;
the index checks member count, names, sizes and .npy headers against the manifest. The shard is then memory-mapped.
When the members sit at a constant stride (always, for shards written by data_prep) the rows are one strided numpy
view of the mapping and a batch is a single fancy-indexing copy; otherwise each row is one slice at its offset.
"""
from __future__ import annotations

import mmap
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import CorruptShardError, DataPrepError
from .manifest import check_tokenizer_hash, corrupt_shard_error, read_manifest, verify_shards
from .shard_writer import member_name, npy_header

CORRUPT_POLICIES = ("error", "skip")
REMEDY = ("re-create the shards with `python -m data_prep shards`, or load with on_corrupt='skip' (a megaloop "
          "config: data.on_corrupt=skip) to leave this shard out (it is counted)")


def _scan_members(path: Path, entry: dict) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Names, data offsets and sizes of the regular members, in archive order."""
    names, offsets, sizes = [], [], []
    try:
        with tarfile.open(path, mode="r:") as archive:
            for info in archive:
                if info.isfile():
                    names.append(info.name)
                    offsets.append(info.offset_data)
                    sizes.append(info.size)
    except (tarfile.TarError, OSError, EOFError) as err:
        after = f" after member {names[-1]}" if names else ""
        raise CorruptShardError(entry["name"], f"unreadable tar data{after} ({err})", REMEDY,
                                member=member_name(entry["first_row"] + len(names))) from err
    return names, np.asarray(offsets, dtype=np.int64), np.asarray(sizes, dtype=np.int64)


@dataclass
class ShardIndex:
    """Where each row's array data starts inside one shard file."""

    name: str
    first_row: int
    rows: int
    data_offsets: np.ndarray
    stride: int | None


def build_shard_index(path: Path, entry: dict, row_len: int, dtype) -> tuple[ShardIndex, bytes]:
    """Index one shard and check it against its manifest entry; errors name the shard and the member.

    Returns the index and the .npy header every member must start with.
    """
    header = npy_header(dtype, row_len)
    expected_size = len(header) + row_len * np.dtype(dtype).itemsize
    names, offsets, sizes = _scan_members(path, entry)
    file_size = path.stat().st_size
    for i in range(min(len(names), entry["rows"])):
        want = member_name(entry["first_row"] + i)
        if names[i] != want or sizes[i] != expected_size or offsets[i] + sizes[i] > file_size:
            problem = (f"member is {names[i]} of {sizes[i]} bytes, expected {want} of {expected_size} bytes"
                       if offsets[i] + sizes[i] <= file_size else "member data runs past the end of the file")
            tokens = (int(sizes[i]) - len(header)) / np.dtype(dtype).itemsize
            if names[i] == want and sizes[i] != expected_size and tokens.is_integer() and tokens > 1:
                problem += (f": it holds a row of {int(tokens)} tokens (seq_len {int(tokens) - 1}), but the manifest "
                            f"records seq_len {row_len - 1}, so the shards and manifest.json disagree")
            raise CorruptShardError(entry["name"], problem, REMEDY, member=want)
    if len(names) != entry["rows"]:
        missing = member_name(entry["first_row"] + len(names)) if len(names) < entry["rows"] else None
        raise CorruptShardError(entry["name"], f"holds {len(names)} rows, the manifest records {entry['rows']} "
                                "(truncated or altered)", REMEDY, member=missing)
    steps = np.diff(offsets)
    if len(offsets) == 1:
        stride = expected_size
    else:
        stride = int(steps[0]) if (steps == steps[0]).all() else None
    return ShardIndex(entry["name"], entry["first_row"], entry["rows"], offsets + len(header), stride), header


class ShardRows:
    """A memory-mapped shard: rows by local index."""

    def __init__(self, path: Path, entry: dict, row_len: int, dtype, vocab_size: int):
        self.name = entry["name"]
        self.row_len, self.dtype, self.vocab_size = row_len, np.dtype(dtype), vocab_size
        self.index, header = build_shard_index(path, entry, row_len, dtype)
        with open(path, "rb") as handle:
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        self._check_npy_headers(header)
        self._view = None
        if self.index.stride is not None:
            self._view = np.ndarray((self.index.rows, row_len), dtype=self.dtype, buffer=self._map,
                                    offset=int(self.index.data_offsets[0]),
                                    strides=(self.index.stride, self.dtype.itemsize))

    def _check_npy_headers(self, header: bytes) -> None:
        """Every member must start with the exact .npy header of a row."""
        expected = np.frombuffer(header, dtype=np.uint8)
        starts = self.index.data_offsets - len(header)
        found = self._bytes[starts[:, None] + np.arange(len(header))[None, :]]
        bad = np.nonzero((found != expected[None, :]).any(axis=1))[0]
        if len(bad):
            raise CorruptShardError(self.name, "member does not hold a .npy row of the recorded dtype and length",
                                    REMEDY, member=member_name(self.index.first_row + int(bad[0])))

    def read(self, local_rows: np.ndarray) -> np.ndarray:
        """Rows [n, row_len] (a copy) for local row indices; ids beyond the vocabulary are a corruption error."""
        if self._view is not None:
            rows = self._view[local_rows]
        else:
            rows = np.stack([np.frombuffer(self._map, dtype=self.dtype, count=self.row_len,
                                           offset=int(self.index.data_offsets[r])) for r in local_rows])
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
        if on_corrupt not in CORRUPT_POLICIES:
            raise DataPrepError(f"unknown on_corrupt policy {on_corrupt!r}", f"use one of {CORRUPT_POLICIES}")
        self.shard_dir = Path(shard_dir)
        self.manifest = read_manifest(shard_dir)
        if tokenizer_hash is not None:
            check_tokenizer_hash(self.manifest, tokenizer_hash)
        if split not in self.manifest["splits"]:
            raise DataPrepError(f"{shard_dir} has no split {split!r}", f"use one of {sorted(self.manifest['splits'])}")
        self.split, self.on_corrupt = split, on_corrupt
        self.seq_len, self.row_len = self.manifest["seq_len"], self.manifest["row_len"]
        self.dtype = np.dtype(self.manifest["dtype"])
        self.pad_id = self.manifest["tokenizer"]["pad_id"]
        self.skipped: list[dict] = []
        self.entries = self._usable_entries(verify)
        self._open: dict[int, ShardRows] = {}
        if on_corrupt == "skip":
            self._index_all_or_skip()
        self._starts = np.cumsum([0] + [e["rows"] for e in self.entries]).astype(np.int64)

    def _usable_entries(self, verify: str) -> list[dict]:
        entries = self.manifest["splits"][self.split]["shards"]
        problems = verify_shards(self.shard_dir, self.manifest, verify, splits=[self.split])
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
        if number not in self._open:
            entry = entry or self.entries[number]
            self._open[number] = ShardRows(self.shard_dir / entry["name"], entry, self.row_len, self.dtype,
                                           self.manifest["tokenizer"]["vocab_size"])
        return self._open[number]

    def close(self) -> None:
        """Forget the open memory maps (they are unmapped once no array refers to them); reopened on demand."""
        self._open.clear()

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
        """Manifest row ids (stable even when shards were skipped) of dataset indices."""
        shard, local = self.locate(indices)
        firsts = np.asarray([e["first_row"] for e in self.entries], dtype=np.int64)
        return firsts[shard] + local

    def read_rows(self, indices: np.ndarray) -> np.ndarray:
        """Rows [len(indices), row_len] in the given order (one copy per shard touched)."""
        shard, local = self.locate(indices)
        out = np.empty((len(shard), self.row_len), dtype=self.dtype)
        for number in np.unique(shard):
            where = np.nonzero(shard == number)[0]
            out[where] = self._shard(int(number)).read(local[where])
        return out
