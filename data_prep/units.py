"""Work units: consecutive pieces of the input files grouped greedily up to a byte budget, each with a key.

A piece is what a reader can read alone (a text or JSON-lines file, a parquet row group). Pieces are taken in
input order and a unit is closed when adding the next piece would pass `unit_bytes` (a unit always holds at least
one piece, so a piece larger than the budget is a unit of its own). A unit's key is the sha256 of the options
fingerprint and of each of its ranges with its file's identity (name, size, mtime_ns): a re-run may reuse a
committed unit only when its key is unchanged.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from .inputs import InputFile

DEFAULT_UNIT_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class PieceRange:
    """Pieces [first, stop) of one input file."""

    file: InputFile
    first: int
    stop: int


@dataclass(frozen=True)
class WorkUnit:
    """One unit of work: its index in the plan, its ranges, its size in (compressed) bytes and its key."""

    index: int
    ranges: tuple[PieceRange, ...]
    size: int
    key: str


def options_fingerprint(options: dict) -> str:
    """sha256 of the options that shape a unit's output, in canonical JSON."""
    return hashlib.sha256(json.dumps(options, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def unit_key(fingerprint: str, ranges: tuple[PieceRange, ...]) -> str:
    digest = hashlib.sha256(fingerprint.encode())
    for r in ranges:
        digest.update(json.dumps([r.file.name, r.file.size, r.file.mtime_ns, r.first, r.stop]).encode())
    return digest.hexdigest()


def plan_units(files: list[tuple[InputFile, list[int]]], unit_bytes: int, fingerprint: str) -> list[WorkUnit]:
    """Group (file, piece sizes) pairs, in order, into units of at most `unit_bytes` (one piece at least)."""
    units: list[WorkUnit] = []
    ranges: list[PieceRange] = []
    size = 0

    def close() -> None:
        nonlocal ranges, size
        if ranges:
            key_ranges = tuple(ranges)
            units.append(WorkUnit(len(units), key_ranges, size, unit_key(fingerprint, key_ranges)))
        ranges, size = [], 0

    for source, pieces in files:
        for index, piece in enumerate(pieces):
            if ranges and size + piece > unit_bytes:
                close()
            last = ranges[-1] if ranges else None
            if last is not None and last.file == source and last.stop == index:
                ranges[-1] = PieceRange(source, last.first, index + 1)
            else:
                ranges.append(PieceRange(source, index, index + 1))
            size += piece
    close()
    return units
