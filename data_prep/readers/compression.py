"""Opening an input file as a stream of decompressed bytes; a truncated stream names the file."""
from __future__ import annotations

import gzip
import zlib

import zstandard

from ..errors import DataPrepError


def _truncated(location: str, compression: str, err: Exception) -> DataPrepError:
    return DataPrepError(f"{location}: the {compression} stream is truncated or corrupt ({err})",
                         "download or re-compress the file again")


def read_all(location: str, compression: str | None) -> bytes:
    """The whole decompressed content (multi-frame zstd and multi-member gzip included)."""
    with open(location, "rb") as handle:
        raw = handle.read()
    if compression is None:
        return raw
    if compression == "gzip":
        try:
            return gzip.decompress(raw)
        except (EOFError, OSError, zlib.error) as err:
            raise _truncated(location, compression, err) from err
    if compression == "zstd":
        return _zstd_frames(location, raw)
    raise DataPrepError(f"{location}: unknown compression {compression}", "use .gz or .zst")


def _zstd_frames(location: str, raw: bytes) -> bytes:
    """Decompress every frame; a frame that does not end (truncation) is an error."""
    out = []
    while raw:
        decomp = zstandard.ZstdDecompressor().decompressobj()
        try:
            out.append(decomp.decompress(raw))
        except zstandard.ZstdError as err:
            raise _truncated(location, "zstd", err) from err
        if not decomp.eof:
            raise _truncated(location, "zstd", EOFError("the last frame ends early"))
        raw = decomp.unused_data
    return b"".join(out)
