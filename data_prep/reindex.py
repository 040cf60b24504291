"""`python -m data_prep reindex --shards DIR`: add member offsets to a manifest written before they were recorded.

Scans every shard once with tarfile (names, sizes and data offsets of its members), checks them against the
manifest entry exactly as a reader would, records each shard's data_offset and stride, and replaces manifest.json
atomically (written to a temporary file, then renamed) with format version 2. The shards are not touched, so the
dataset's fingerprint and every saved loader state stay valid. A directory that already has offsets is left as it is.
"""
from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np

from .errors import CorruptShardError, DataPrepError
from .manifest import (FORMAT, FORMAT_VERSION, MANIFEST_FILE, READABLE_VERSIONS, UNINDEXED_VERSION,
                       corrupt_shard_error, read_manifest, shard_problem, write_manifest)
from .shard_reader import REMEDY
from .shard_writer import member_layout, member_name, npy_header


def scan_members(path: Path, entry: dict) -> tuple[list[str], np.ndarray, np.ndarray]:
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


def scanned_layout(path: Path, entry: dict, row_len: int, dtype) -> dict:
    """{"data_offset", "stride"} of one shard from a scan of its tar headers, checked against its manifest entry."""
    header = npy_header(dtype, row_len)
    expected_size = len(header) + row_len * np.dtype(dtype).itemsize
    names, offsets, sizes = scan_members(path, entry)
    wanted = [member_name(entry["first_row"] + i) for i in range(entry["rows"])]
    for i, (name, size) in enumerate(zip(names, sizes)):
        if i >= len(wanted) or name != wanted[i] or size != expected_size:
            want = wanted[i] if i < len(wanted) else "no member"
            raise CorruptShardError(entry["name"], f"member is {name} of {size} bytes, expected {want} of "
                                    f"{expected_size} bytes", REMEDY, member=name)
    if len(names) != entry["rows"]:
        raise CorruptShardError(entry["name"], f"holds {len(names)} rows, the manifest records {entry['rows']} "
                                "(truncated or altered)", REMEDY, member=wanted[len(names)])
    try:
        return member_layout(offsets, len(header), expected_size)
    except ValueError as err:
        raise CorruptShardError(entry["name"], f"{err}, so it was not written by data_prep", REMEDY) from None


def reindex(shard_dir) -> dict:
    """Record every shard's member layout in the manifest of `shard_dir`; returns {"shards": n, "changed": bool}."""
    shard_dir = Path(shard_dir)
    path = shard_dir / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
        version = manifest.get("format_version") if manifest.get("format") == FORMAT else None
    except (OSError, ValueError, AttributeError):
        version = None
    if version in READABLE_VERSIONS:
        read_manifest(shard_dir)  # a complete version-2 or -3 manifest: nothing to do
        return {"shards": sum(len(s["shards"]) for s in manifest["splits"].values()), "changed": False}
    if version != UNINDEXED_VERSION:
        read_manifest(shard_dir)  # raises the reader's own error (no manifest, not JSON, another format)
        raise DataPrepError(f"{path} is not a data_prep manifest of version {UNINDEXED_VERSION} or "
                            f"{FORMAT_VERSION}", "re-create the shards with this version of data_prep")
    count = 0
    try:
        for split in sorted(manifest["splits"]):
            for entry in manifest["splits"][split]["shards"]:
                problem = shard_problem(shard_dir, entry, "fast")
                if problem:
                    raise corrupt_shard_error(entry["name"], problem)
                entry.update(scanned_layout(shard_dir / entry["name"], entry, manifest["row_len"], manifest["dtype"]))
                count += 1
    except (KeyError, TypeError, AttributeError) as err:
        raise DataPrepError(f"{path} lacks a field every shard directory has ({type(err).__name__}: {err})",
                            "re-create the shards with `python -m data_prep shards`") from None
    manifest["format_version"] = FORMAT_VERSION
    write_manifest(shard_dir, manifest)
    read_manifest(shard_dir)
    return {"shards": count, "changed": True}
