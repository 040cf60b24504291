"""JSON lines (optionally .gz/.zst): one object per line; the whole file is one piece."""
from __future__ import annotations

import json
from typing import Iterator

from ..errors import DataPrepError
from ..inputs import InputFile
from .base import ReadOptions, Record
from .compression import read_all
from .fields import bad_record, row_to_record


class JsonlReader:
    def __init__(self, source: InputFile, options: ReadOptions):
        self.source, self.options = source, options

    def pieces(self) -> list[int]:
        return [self.source.size]

    def read(self, first: int = 0, stop: int | None = None) -> Iterator[Record]:
        if first > 0 or stop == 0:
            return
        data = read_all(self.source.location, self.source.compression)
        for number, line in enumerate(data.split(b"\n"), start=1):
            if not line.strip():
                continue
            key = f"{self.source.name}:{number}"
            where = f"{self.source.name} line {number}"
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                yield bad_record(Record(key), f"{where}: not valid JSON ({err.args[0]})", self.options)
                continue
            if not isinstance(row, dict):
                yield bad_record(Record(key), f"{where}: a JSON {type(row).__name__}, not an object", self.options)
                continue
            if not self.options.tokens_field and self.options.text_field not in row and number == 1:
                raise DataPrepError(f"{where}: no field {self.options.text_field!r} (fields: {sorted(row)})",
                                    "pass --text-field naming the field that holds the text")
            yield row_to_record(row, key, self.options, where)
