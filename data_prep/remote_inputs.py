"""Input files at s3:// or http(s):// URLs, through the stores the loader uses (data_prep.stores: retries on
transient failures, a 404 or access error at once).

Planning reads only each object's size (a HEAD), so every task of a job plans without downloading anything: a remote
file is one piece (a remote parquet file is one piece whatever its row groups; a local copy of it is planned by row
group, so the two preparations cut different units). A unit downloads its remote files into a temporary directory
(TMPDIR: node-local disk), reads them as local files and deletes them when the unit is written.
"""
from __future__ import annotations

import contextlib
import dataclasses
import posixpath
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

from .errors import DataPrepError, EmptyCorpusError
from .stores import StoreError, is_remote, open_store


def _split(url: str) -> tuple[str, str]:
    """(the store's base URL, the object's name) of a file URL."""
    base, _, name = url.rstrip("/").rpartition("/")
    if not name or base.endswith(":/"):
        raise DataPrepError(f"--input {url} names no file", "give the URL of a .parquet, .jsonl[.gz|.zst] or text file")
    return base, name


def resolve_remote(specs: list[str], fmt: str | None, s3_endpoint: str | None):
    """InputFiles of file URLs (sizes from the store), named by their path below the URLs' common folder."""
    from .inputs import InputFile, detect_format

    if any(any(ch in s for ch in "*?[") for s in specs):
        raise EmptyCorpusError(f"--input {specs}: globs are not expanded in URLs", "list the files' URLs")
    if len(set(specs)) != len(specs):
        raise DataPrepError(f"input {sorted(s for s in specs if specs.count(s) > 1)[0]} is given more than once",
                            "list each input once")
    paths = [urlsplit(s).netloc + urlsplit(s).path for s in specs]
    common = posixpath.commonpath([posixpath.dirname(p) for p in paths]) if len(paths) > 1 else \
        posixpath.dirname(paths[0])
    files = []
    for spec, path in zip(specs, paths):
        kind, compression = detect_format(path)
        if fmt and kind != fmt:
            raise DataPrepError(f"{spec} is {kind} but --format {fmt} was given",
                                f"select only {fmt} files or change --format")
        base, name = _split(spec)
        try:
            size = open_store(base, s3_endpoint=s3_endpoint).size(name)
        except StoreError as err:
            raise DataPrepError(err.problem,
                                "check the --input URL and your access to it (credentials, --s3-endpoint)") from None
        files.append(InputFile(posixpath.relpath(path, common), spec, size, 0, kind, compression))
    files.sort(key=lambda f: f.name)
    kinds = sorted({f.format for f in files})
    if len(kinds) > 1:
        raise DataPrepError(f"inputs mix formats {kinds}", "prepare one format at a time")
    return files


@contextlib.contextmanager
def local_copy(source, s3_endpoint: str | None = None):
    """The InputFile itself when local; else one whose location is a downloaded copy, removed afterwards."""
    if not is_remote(source.location):
        yield source
        return
    base, name = _split(source.location)
    with tempfile.TemporaryDirectory(prefix="data_prep-input-") as tmp:
        path = Path(tmp) / name
        try:
            with open(path, "wb") as out:
                open_store(base, s3_endpoint=s3_endpoint).download(name, out)
        except StoreError as err:
            raise DataPrepError(err.problem,
                                "check the --input URL and your access to it, then run the same command again") \
                from None
        yield dataclasses.replace(source, location=str(path))
