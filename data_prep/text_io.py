"""Reading a directory of text files as documents (one file = one document).

Rules, applied the same way by tokenizer training and by sharding:
- files are found recursively under the input directory, matched by a glob on the file name (default: every file),
  hidden files and directories (names starting with '.') are ignored, and the order is the sorted relative POSIX
  path, so the document order never depends on the file system or on the number of workers;
- a leading UTF-8 byte-order mark is dropped, CRLF and lone CR line ends become LF;
- bytes that are not valid UTF-8 are replaced by U+FFFD and counted (`replaced_bytes`);
- a file is skipped, with its reason counted, when it is empty ("empty"), holds a NUL byte in its first 8 KiB
  ("binary"), or has more than `max_invalid_fraction` of its bytes replaced ("mostly invalid UTF-8").
"""
from __future__ import annotations

import codecs
import fnmatch
import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from .errors import DataPrepError, EmptyCorpusError

BINARY_PROBE_BYTES = 8192
DEFAULT_MAX_INVALID_FRACTION = 0.1
UTF8_BOM = b"\xef\xbb\xbf"
SKIP_EMPTY = "empty"
SKIP_BINARY = "binary (NUL byte)"
SKIP_INVALID = "mostly invalid UTF-8"


@dataclass(frozen=True)
class SourceFile:
    """One candidate document: its path relative to the input directory and its size in bytes."""

    relpath: str
    size: int


@dataclass
class Document:
    """The decoded text of one file with what reading it found."""

    relpath: str
    text: str
    size: int
    sha256: str
    replaced_bytes: int
    skip_reason: str | None = None


def list_source_files(input_dir: str | os.PathLike, glob: str = "*") -> list[SourceFile]:
    """All matching regular files under `input_dir`, sorted by relative POSIX path.

    Raises EmptyCorpusError when the directory does not exist or holds no matching file.
    """
    root = Path(input_dir)
    if not root.is_dir():
        raise EmptyCorpusError(f"input directory {root} does not exist or is not a directory",
                               "pass --input a directory that holds text files")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            if name.startswith(".") or not fnmatch.fnmatch(name, glob):
                continue
            path = Path(dirpath) / name
            if path.is_file():
                found.append(SourceFile(path.relative_to(root).as_posix(), path.stat().st_size))
    found.sort(key=lambda f: f.relpath)
    if not found:
        raise EmptyCorpusError(f"input directory {root} holds no file matching {glob!r}",
                               "point --input at a directory of text files (searched recursively), or change --glob")
    return found


def probe_skip_reason(path: str | os.PathLike, size: int) -> str | None:
    """A cheap look at a file before reading it in full: "empty", "binary (NUL byte)" or None."""
    if size == 0:
        return SKIP_EMPTY
    with open(path, "rb") as handle:
        head = handle.read(BINARY_PROBE_BYTES)
    return SKIP_BINARY if b"\x00" in head else None


_REPLACED = threading.local()
COUNTING_ERROR_HANDLER = "data_prep.count_and_replace"


def _count_and_replace(err: UnicodeDecodeError):
    """Codec error handler: like "replace" (one U+FFFD per invalid sequence), counting the bytes replaced."""
    _REPLACED.count += err.end - err.start
    return "\ufffd", err.end


codecs.register_error(COUNTING_ERROR_HANDLER, _count_and_replace)


def decode_utf8_counting(data: bytes) -> tuple[str, int]:
    """Decode UTF-8, replacing each invalid byte sequence by U+FFFD; returns (text, number of bytes replaced)."""
    try:
        return data.decode("utf-8"), 0
    except UnicodeDecodeError:
        pass
    _REPLACED.count = 0
    text = data.decode("utf-8", errors=COUNTING_ERROR_HANDLER)
    return text, _REPLACED.count


def normalise_text(data: bytes) -> tuple[str, int]:
    """Bytes of a file -> (text without BOM, LF line ends, invalid bytes replaced; replaced byte count)."""
    if data.startswith(UTF8_BOM):
        data = data[len(UTF8_BOM):]
    text, replaced = decode_utf8_counting(data)
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text, replaced


def read_document(root: str | os.PathLike, source: SourceFile,
                  max_invalid_fraction: float = DEFAULT_MAX_INVALID_FRACTION) -> Document:
    """Read and normalise one file. A skipped file comes back with `skip_reason` set and empty text."""
    path = Path(root) / source.relpath
    try:
        data = path.read_bytes()
    except OSError as err:
        raise DataPrepError(f"cannot read {path}: {err}", "check the file's permissions or remove it") from err
    digest = hashlib.sha256(data).hexdigest()
    doc = Document(source.relpath, "", len(data), digest, 0)
    if not data:
        doc.skip_reason = SKIP_EMPTY
        return doc
    if b"\x00" in data[:BINARY_PROBE_BYTES]:
        doc.skip_reason = SKIP_BINARY
        return doc
    text, replaced = normalise_text(data)
    doc.replaced_bytes = replaced
    if replaced > max_invalid_fraction * len(data):
        doc.skip_reason = SKIP_INVALID
        return doc
    doc.text = text
    return doc


def iter_documents(root: str | os.PathLike, sources: list[SourceFile],
                   max_invalid_fraction: float = DEFAULT_MAX_INVALID_FRACTION):
    """Yield a Document per source file, in order (skipped ones included, flagged)."""
    for source in sources:
        yield read_document(root, source, max_invalid_fraction)
