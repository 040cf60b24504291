"""Parquet files read by ranges of row groups (each row group is one piece, sized by its compressed bytes)."""
from __future__ import annotations

from typing import Iterator

import pyarrow
import pyarrow.parquet as pq

from ..errors import DataPrepError
from ..inputs import InputFile
from .base import ReadOptions, Record
from .fields import row_to_record


class ParquetReader:
    def __init__(self, source: InputFile, options: ReadOptions):
        self.source, self.options = source, options
        try:
            self.file = pq.ParquetFile(source.location)
        except (pyarrow.ArrowException, OSError) as err:
            raise DataPrepError(f"{source.location}: not a readable parquet file ({err})",
                                "download the file again; it is truncated or corrupt") from err
        names = self.file.schema_arrow.names
        wanted = options.tokens_field or options.text_field
        if wanted not in names:
            raise DataPrepError(f"{source.name}: no column {wanted!r} (columns: {names})",
                                "pass --text-field (or --tokens-field) naming the right column")
        self.columns = [c for c in dict.fromkeys([wanted, options.id_field, *options.meta_fields]) if c]

    def pieces(self) -> list[int]:
        meta = self.file.metadata
        return [sum(meta.row_group(g).column(c).total_compressed_size for c in range(meta.num_columns))
                for g in range(meta.num_row_groups)]

    def read(self, first: int = 0, stop: int | None = None) -> Iterator[Record]:
        meta = self.file.metadata
        stop = meta.num_row_groups if stop is None else stop
        row = sum(meta.row_group(g).num_rows for g in range(first))
        for group in range(first, stop):
            try:
                table = self.file.read_row_group(group, columns=self.columns)
            except (pyarrow.ArrowException, OSError) as err:
                raise DataPrepError(f"{self.source.name}: row group {group} cannot be read ({err})",
                                    "download the file again; it is truncated or corrupt") from err
            for values in table.to_pylist():
                key = f"{self.source.name}:{row}"
                yield row_to_record(values, key, self.options, f"{self.source.name} row {row}")
                row += 1
