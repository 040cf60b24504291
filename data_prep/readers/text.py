"""A text file (optionally .gz/.zst) as one document, normalised as text_io does."""
from __future__ import annotations

from typing import Iterator

from ..inputs import InputFile
from ..text_io import BINARY_PROBE_BYTES, SKIP_BINARY, SKIP_EMPTY, SKIP_INVALID, normalise_text
from .base import ReadOptions, Record
from .compression import read_all


class TextReader:
    def __init__(self, source: InputFile, options: ReadOptions):
        self.source, self.options = source, options

    def pieces(self) -> list[int]:
        return [self.source.size]

    def read(self, first: int = 0, stop: int | None = None) -> Iterator[Record]:
        if first > 0 or stop == 0:
            return
        data = read_all(self.source.location, self.source.compression)
        record = Record(self.source.name)
        if not data:
            record.skip_reason = SKIP_EMPTY
        elif b"\x00" in data[:BINARY_PROBE_BYTES]:
            record.skip_reason = SKIP_BINARY
        else:
            text, replaced = normalise_text(data)
            if replaced > self.options.max_invalid_fraction * len(data):
                record.skip_reason = SKIP_INVALID
            else:
                record.text = text
        yield record
