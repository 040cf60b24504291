"""Input files for sharding and tokenizer training: what each file is and how it is stored.

A file's format is named by its suffix and checked against its first bytes:
- `.parquet` (never compressed on top: parquet compresses its own pages),
- `.jsonl`, `.json`, `.ndjson` (one JSON object per line),
- anything else is a text file (one file = one document);
each optionally followed by `.gz` or `.zst`.
"""
from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import DataPrepError, EmptyCorpusError

FORMATS = ("text", "jsonl", "parquet")
COMPRESSIONS = {".gz": "gzip", ".zst": "zstd"}
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_MAGIC = b"PAR1"
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


@dataclass(frozen=True)
class InputFile:
    """One input file: its name relative to the inputs' common parent, where it is, and how to read it."""

    name: str
    location: str
    size: int
    mtime_ns: int
    format: str
    compression: str | None


def detect_format(name: str) -> tuple[str, str | None]:
    """(format, compression) named by a file's suffixes; refuses a compressed parquet file."""
    lower = name.lower()
    compression = None
    for suffix, kind in COMPRESSIONS.items():
        if lower.endswith(suffix):
            compression, lower = kind, lower[: -len(suffix)]
            break
    if lower.endswith(".parquet"):
        if compression:
            raise DataPrepError(f"{name}: a parquet file compressed with {compression} cannot be read in row groups",
                                "decompress it: parquet already compresses its pages")
        return "parquet", None
    if lower.endswith(JSONL_SUFFIXES):
        return "jsonl", compression
    return "text", compression


def check_content(path: str | os.PathLike, fmt: str, compression: str | None) -> None:
    """Raise DataPrepError when a local file's first bytes contradict its suffix."""
    with open(path, "rb") as handle:
        head = handle.read(4)
    if not head:
        return
    expected = {"gzip": GZIP_MAGIC, "zstd": ZSTD_MAGIC}.get(compression or "")
    if expected and not head.startswith(expected):
        raise DataPrepError(f"{path}: named as {compression}-compressed but its first bytes are not",
                            "rename the file to match its content")
    if fmt == "parquet" and head != PARQUET_MAGIC:
        raise DataPrepError(f"{path}: named .parquet but does not start with the parquet magic bytes",
                            "check the file is a complete parquet file, or rename it")


def walk(root: Path, name_glob: str) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in filenames:
            if not name.startswith(".") and fnmatch.fnmatch(name, name_glob):
                found.append(Path(dirpath) / name)
    return found


def _expand(spec: str, name_glob: str) -> list[Path]:
    path = Path(spec)
    if path.is_dir():
        return walk(path, name_glob)
    if path.is_file():
        return [path]
    if any(ch in spec for ch in "*?["):
        parent = Path(spec).parent
        return [p for p in sorted(parent.glob(Path(spec).name)) if p.is_file()]
    raise EmptyCorpusError(f"input {spec} does not exist", "pass --input an existing file, directory or glob")


def resolve_inputs(specs: list[str], name_glob: str = "*", fmt: str | None = None,
                   s3_endpoint: str | None = None) -> list[InputFile]:
    """Local directories, globs and files (or s3:// and http(s):// file URLs: data_prep.remote_inputs) ->
    InputFiles sorted by name (relative to their common parent).

    All files must have one format; `fmt`, when given, must be that format. Duplicates are refused.
    """
    from .stores import is_remote

    remote = [is_remote(s) for s in specs]
    if any(remote):
        if not all(remote):
            raise DataPrepError(f"--input mixes local paths and URLs ({specs})",
                                "prepare local files and remote ones in separate runs, or copy them to one place")
        from .remote_inputs import resolve_remote

        return resolve_remote(list(specs), fmt, s3_endpoint)
    paths = [p.resolve() for spec in specs for p in _expand(spec, name_glob)]
    if not paths:
        raise EmptyCorpusError(f"no input file matches {specs} (name glob {name_glob!r})",
                               "point --input at files, a directory or a glob that matches some")
    if len(set(paths)) != len(paths):
        dup = sorted(p for p in set(paths) if paths.count(p) > 1)[0]
        raise DataPrepError(f"input file {dup} is given more than once", "list each input once")
    roots = [p if Path(s).is_dir() else p.parent for s in specs for p in [Path(s).resolve()]]
    common = Path(os.path.commonpath([str(p.parent) for p in paths] + [str(r) for r in roots]))
    files = []
    for path in paths:
        kind, compression = detect_format(path.name)
        if fmt and kind != fmt:
            raise DataPrepError(f"{path} is {kind} but --format {fmt} was given",
                                f"select only {fmt} files (--glob) or change --format")
        check_content(path, kind, compression)
        stat = path.stat()
        files.append(InputFile(path.relative_to(common).as_posix(), str(path), stat.st_size, stat.st_mtime_ns,
                               kind, compression))
    files.sort(key=lambda f: f.name)
    kinds = sorted({f.format for f in files})
    if len(kinds) > 1:
        raise DataPrepError(f"inputs mix formats {kinds}", "prepare one format at a time, or select files with --glob")
    return files
