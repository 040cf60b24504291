"""Packing token streams into rows and writing them as deterministic webdataset tar shards.

A split's documents become one stream  BOS d0 EOS BOS d1 EOS ...  cut into consecutive, non-overlapping rows of
row_len = seq_len + 1 tokens (documents span rows freely). Only the final, incomplete row could need padding: it is
dropped by default, or padded with PAD when asked to keep it. That is the `stream` packing mode; data_prep.packing
holds the default of `data_prep shards`, BOS-aligned best fit, where every row starts at a document's BOS.

Each row is one tar member named `{row:010d}.npy` (row = index of the row within its split), holding a 1-D .npy
array (uint16 when every id fits, else uint32), exactly what `numpy.save` writes. Tar headers are fixed (mtime 0,
uid/gid 0, empty user/group names, mode 0644, ustar format) so equal rows always give byte-identical shards.
Shards are named `{split}-{number:06d}.tar` and hold `rows_per_shard` rows (the last one fewer).

Every member has the same size, so the members sit at a constant stride: the manifest records, per shard, the byte
offset of the first row's array data (`data_offset`, past its tar and .npy headers) and the `stride` between rows,
and readers map the rows from these two numbers without scanning the archive.
"""
from __future__ import annotations

import hashlib
import io
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

BLOCK = 512
RECORD = 20 * BLOCK
MEMBER_NAME_DIGITS = 10


def member_name(row: int) -> str:
    """Tar member name of a row."""
    return f"{row:0{MEMBER_NAME_DIGITS}d}.npy"


def shard_name(split: str, number: int) -> str:
    """File name of a shard."""
    return f"{split}-{number:06d}.tar"


def npy_header(dtype, length: int) -> bytes:
    """The header numpy.save writes for a 1-D C-ordered array of `length` elements of `dtype`."""
    buffer = io.BytesIO()
    header = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False, "shape": (length,)}
    np.lib.format.write_array_header_1_0(buffer, header)
    return buffer.getvalue()


def tar_header(name: str, size: int) -> bytes:
    """A ustar header block with fixed metadata."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0
    info.mode = 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.type = tarfile.REGTYPE
    return info.tobuf(format=tarfile.USTAR_FORMAT, encoding="utf-8", errors="strict")


class MemberHeaders:
    """tar_header() for many members of one size, fast: a template with only the name and checksum filled in.

    The ustar checksum is the byte sum of the header with its checksum field read as spaces, so it is the
    template's sum plus the name's bytes.
    """

    NAME_FIELD = slice(0, 100)
    CHECKSUM_FIELD = slice(148, 156)

    def __init__(self, size: int):
        template = bytearray(tar_header("x", size))
        template[self.NAME_FIELD] = bytes(100)
        template[self.CHECKSUM_FIELD] = b" " * 8
        self._template, self._base_sum = bytes(template), sum(template)

    def __call__(self, name: str) -> bytes:
        encoded = name.encode("utf-8")
        if len(encoded) > 100:
            raise ValueError(f"member name {name!r} is longer than 100 bytes")
        header = bytearray(self._template)
        header[:len(encoded)] = encoded
        header[self.CHECKSUM_FIELD] = b"%06o\0 " % (self._base_sum + sum(encoded))
        return bytes(header)


class TarFileWriter:
    """Writes one tar archive member by member, hashing the bytes as they go."""

    def __init__(self, path: Path):
        self.path = path
        self._file = open(path, "wb")
        self._sha = hashlib.sha256()
        self.size = 0
        self._headers: dict[int, MemberHeaders] = {}
        self.data_offsets: list[int] = []  # where each member's payload starts

    def _write(self, data: bytes) -> None:
        self._file.write(data)
        self._sha.update(data)
        self.size += len(data)

    def add(self, name: str, payload: bytes) -> None:
        """Append a regular file member."""
        if len(payload) not in self._headers:
            self._headers[len(payload)] = MemberHeaders(len(payload))
        self._write(self._headers[len(payload)](name))
        self.data_offsets.append(self.size)
        self._write(payload)
        remainder = len(payload) % BLOCK
        if remainder:
            self._write(b"\0" * (BLOCK - remainder))

    def close(self) -> tuple[int, str]:
        """Write the end-of-archive blocks, pad to a whole record; returns (size in bytes, sha256 hex)."""
        self._write(b"\0" * (2 * BLOCK))
        remainder = self.size % RECORD
        if remainder:
            self._write(b"\0" * (RECORD - remainder))
        self._file.close()
        return self.size, self._sha.hexdigest()


def member_layout(payload_offsets, npy_header_len: int, payload_len: int) -> dict:
    """{"data_offset": where row 0's array data starts, "stride": bytes from one row to the next} of a shard whose
    members' payloads (.npy header + data) start at `payload_offsets`; ValueError when they are not equally spaced
    (only a shard written by another tool can be so)."""
    offsets = np.asarray(payload_offsets, dtype=np.int64)
    steps = np.diff(offsets)
    if len(offsets) == 0 or (steps.size and (steps != steps[0]).any()):
        raise ValueError("the members are not equally spaced")
    stride = int(steps[0]) if steps.size else BLOCK + -(-int(payload_len) // BLOCK) * BLOCK
    return {"data_offset": int(offsets[0]) + int(npy_header_len), "stride": stride}


@dataclass
class SplitShardWriter:
    """Rolls rows of one split into shards of `rows_per_shard` rows each."""

    out_dir: Path
    split: str
    rows_per_shard: int
    row_len: int
    dtype: type
    shards: list = field(default_factory=list)
    rows_written: int = 0
    _current: TarFileWriter | None = None
    _rows_in_current: int = 0
    _first_row: int = 0

    def __post_init__(self):
        self._header = npy_header(self.dtype, self.row_len)

    def add_rows(self, rows: np.ndarray) -> None:
        """Append rows (a [n, row_len] array of `dtype`)."""
        rows = np.ascontiguousarray(rows, dtype=self.dtype)
        for row in rows:
            if self._current is None:
                path = Path(self.out_dir) / shard_name(self.split, len(self.shards))
                self._current, self._rows_in_current, self._first_row = TarFileWriter(path), 0, self.rows_written
            self._current.add(member_name(self.rows_written), self._header + row.tobytes())
            self.rows_written += 1
            self._rows_in_current += 1
            if self._rows_in_current == self.rows_per_shard:
                self._close_current()

    def _close_current(self) -> None:
        offsets = self._current.data_offsets
        size, digest = self._current.close()
        self.shards.append({"name": self._current.path.name, "rows": self._rows_in_current,
                            "first_row": self._first_row, "size": size, "sha256": digest,
                            **member_layout(offsets, len(self._header),
                                              len(self._header) + self.row_len * np.dtype(self.dtype).itemsize)})
        self._current = None

    def close(self) -> list[dict]:
        """Finish the last shard; returns one dict per shard (name, rows, first_row, size, sha256, data_offset,
        stride)."""
        if self._current is not None:
            self._close_current()
        return self.shards


@dataclass
class RowPacker:
    """Joins documents as BOS doc EOS into one stream and hands out complete rows of `row_len` tokens (the `stream`
    packing mode, data_prep.packing). Counts, once finished, what the tail cost: dropped_tokens, padded_tokens and
    cut_documents (the documents with tokens in a dropped tail)."""

    row_len: int
    bos_id: int
    eos_id: int
    pad_id: int
    dtype: type
    stream_tokens: int = 0
    documents: int = 0
    dropped_tokens: int = 0
    padded_tokens: int = 0
    cut_documents: int = 0
    _carry: np.ndarray = None
    _carry_starts: list = None  # where documents start within the carry

    def __post_init__(self):
        self._carry = np.empty(0, dtype=self.dtype)
        self._carry_starts = []

    def add_document(self, tokens: np.ndarray) -> np.ndarray:
        """Add one document's tokens (without BOS/EOS); returns the rows it completed, shape [n, row_len]."""
        framed = np.empty(len(self._carry) + len(tokens) + 2, dtype=self.dtype)
        framed[:len(self._carry)] = self._carry
        framed[len(self._carry)] = self.bos_id
        framed[len(self._carry) + 1:-1] = tokens
        framed[-1] = self.eos_id
        self.stream_tokens += len(tokens) + 2
        self.documents += 1
        full = len(framed) // self.row_len
        cut = full * self.row_len
        self._carry_starts = [s - cut for s in self._carry_starts + [len(self._carry)] if s >= cut]
        self._carry = framed[cut:].copy()
        return framed[:cut].reshape(full, self.row_len)

    def finish(self, keep_partial: bool) -> tuple[np.ndarray, int, int]:
        """The last incomplete row: (rows [0 or 1, row_len], padded tokens, dropped tokens)."""
        tail = len(self._carry)
        if tail == 0:
            return np.empty((0, self.row_len), dtype=self.dtype), 0, 0
        if not keep_partial:
            self.dropped_tokens += tail
            self.cut_documents += len(self._carry_starts) + (not self._carry_starts or self._carry_starts[0] > 0)
            return np.empty((0, self.row_len), dtype=self.dtype), 0, tail
        row = np.full((1, self.row_len), self.pad_id, dtype=self.dtype)
        row[0, :tail] = self._carry
        self.padded_tokens += self.row_len - tail
        return row, self.row_len - tail, 0
