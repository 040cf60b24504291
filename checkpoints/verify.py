"""Integrity check of a committed checkpoint against its manifest.

Every file the writer produced is listed in ``manifest.json`` with its size and CRC-32. A check compares each
listed file of the selected arrays (and ``metadata.json``) with the disk, and also looks for what the manifest
cannot vouch for: chunk files an array needs that are not listed, and files on disk that are not listed.
"""
from __future__ import annotations

import itertools
import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import files
from .errors import CheckpointError
from .pieces import ITEMSIZE, chunk_key
from .policy import check_array_json

ALWAYS_PRESENT = {"COMMIT", "manifest.json"}  # not listed in the manifest (written after it)


def chunk_files(name: str, shape: tuple, chunks: tuple) -> list[str]:
    """Relative paths of every chunk file of an array (our writer writes all of them; none for an empty array)."""
    if math.prod(shape) == 0:
        return []
    grid = [range(s // c) for s, c in zip(shape, chunks)]
    return [f"{name}/{chunk_key(idx)}" for idx in itertools.product(*grid)]


def find_problems(path: Path, arrays: dict, manifest: dict, names=None, limit: int | None = None) -> list[str]:
    """Problems found ("array 'x': file: what"), at most `limit`. `arrays` maps name -> (shape, dtype, chunks)
    as recorded in metadata.json; `names` None checks every file of the checkpoint."""
    listed = manifest["files"]
    scope = sorted(arrays) if names is None else list(names)
    owner = {"metadata.json": None}
    problems = [] if "metadata.json" in listed else [_say(None, "metadata.json", "missing from manifest.json")]
    for name in scope:
        shape, dtype, chunks = arrays[name]
        chunk_size = math.prod(chunks) * ITEMSIZE[dtype]
        for rel in [f"{name}/zarr.json", *chunk_files(name, shape, chunks)]:
            owner[rel] = name
            if rel not in listed:
                problems.append(_say(name, rel, "missing from manifest.json (the file was never recorded)"))
            elif rel != f"{name}/zarr.json" and listed[rel].get("size") != chunk_size:
                problems.append(_say(name, rel, f"manifest.json lists {listed[rel].get('size')} bytes but a chunk "
                                                f"of this array has {chunk_size}"))
    if names is None:
        owner.update({rel: None for rel in listed if rel not in owner})
    problems += _compare(path, listed, [r for r in owner if r in listed], owner)
    problems += _unlisted_files(path, listed, scope if names is not None else None, owner)
    if not problems:
        problems += _refused_arrays(path, arrays, scope)
    return problems[:limit] if limit else problems


def _say(array, rel, what) -> str:
    return f"array {array!r}: {rel}: {what}" if array else f"{rel}: {what}"


def _compare(path: Path, listed: dict, rels: list[str], owner: dict) -> list[str]:
    def one(rel):
        want = listed[rel]
        try:
            size, digest = files.file_digest(path / rel)
        except FileNotFoundError:
            return _say(owner.get(rel), rel, "file missing")
        except OSError as exc:
            return _say(owner.get(rel), rel, f"unreadable ({exc})")
        if size != want.get("size"):
            kind = "truncated" if size < want.get("size", 0) else "size mismatch"
            return _say(owner.get(rel), rel, f"{kind}: {size} bytes, manifest says {want.get('size')}")
        if digest != want.get(files.HASH_ALGORITHM):
            return _say(owner.get(rel), rel, f"checksum mismatch ({files.HASH_ALGORITHM} {digest}, manifest says "
                                             f"{want.get(files.HASH_ALGORITHM)})")
        return None
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return [p for p in pool.map(one, rels) if p]


def _unlisted_files(path: Path, listed: dict, scope, owner: dict) -> list[str]:
    """Files on disk that the manifest does not list, inside the checked arrays (or anywhere, for a full check)."""
    dirs = [path / name for name in scope] if scope is not None else [path]
    found = []
    for top in dirs:
        for dirpath, _, filenames in os.walk(top):
            for fn in filenames:
                rel = (Path(dirpath) / fn).relative_to(path).as_posix()
                if rel not in listed and rel not in ALWAYS_PRESENT:
                    found.append(_say(_array_of(rel, owner), rel, "on disk but not in manifest.json"))
    return sorted(found)


def _array_of(rel: str, owner: dict) -> str | None:
    for name in {v for v in owner.values() if v}:
        if rel.startswith(name + "/"):
            return name
    return None


def _refused_arrays(path: Path, arrays: dict, scope) -> list[str]:
    out = []
    for name in scope:
        try:
            check_array_json(path / name / "zarr.json", name, *arrays[name])
        except CheckpointError as exc:
            out.append(_say(name, f"{name}/zarr.json", str(exc)))
    return out
