"""A text file (optionally .gz/.zst) as one document, normalised as text_io does."""
from __future__ import annotations

from typing import Iterator

from ..text_io import BINARY_PROBE_BYTES, SKIP_BINARY, SKIP_EMPTY, SKIP_INVALID, normalise_text
from .base import Record, WholeFileReader


class TextReader(WholeFileReader):
    def read(self, first: int = 0, stop: int | None = None) -> Iterator[Record]:
        data = self._whole_file(first, stop)
        if data is None:
            return
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
