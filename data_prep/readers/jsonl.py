"""JSON lines (optionally .gz/.zst): one object per line; the whole file is one piece."""
from __future__ import annotations

import json
from typing import Iterator

from ..errors import DataPrepError
from .base import Record, WholeFileReader
from .fields import bad_record, row_to_record


class JsonlReader(WholeFileReader):
    def read(self, first: int = 0, stop: int | None = None) -> Iterator[Record]:
        data = self._whole_file(first, stop)
        if data is None:
            return
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
