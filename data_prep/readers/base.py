"""What every reader yields and the options they share."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Protocol

from ..inputs import InputFile


@dataclass(frozen=True)
class ReadOptions:
    """Which fields hold the text, token ids, id and metadata; what to do with a bad record."""

    text_field: str = "text"
    tokens_field: str | None = None
    id_field: str | None = None
    meta_fields: tuple[str, ...] = ()
    on_bad_record: str = "error"  # error | skip
    max_invalid_fraction: float = 0.1
    s3_endpoint: str | None = None  # remote inputs (execution only: never changes what is read)


@dataclass
class Record:
    """One document: a key unique in the corpus, its text (or token ids), and why it was skipped, if it was."""

    key: str
    text: str = ""
    tokens: list[int] | None = None
    meta: dict = field(default_factory=dict)
    skip_reason: str | None = None


class DocumentReader(Protocol):
    """Reads one input file as a sequence of pieces (units of work) and the records of a range of pieces."""

    def pieces(self) -> list[int]:
        """Compressed size in bytes of each piece (a text or jsonl file is one piece; a parquet row group is one)."""

    def read(self, first: int = 0, stop: int | None = None) -> Iterator[Record]:
        """The records of pieces [first, stop), in order."""


class WholeFileReader:
    """A reader whose file is one piece (text, JSON lines): the piece's size, and the file's (decompressed) bytes
    when a read asks for that piece."""

    def __init__(self, source: InputFile, options: ReadOptions):
        self.source, self.options = source, options

    def pieces(self) -> list[int]:
        return [self.source.size]

    def _whole_file(self, first: int, stop: int | None) -> bytes | None:
        """The file's bytes when the range [first, stop) holds its one piece, else None."""
        from .compression import read_all

        if first > 0 or stop == 0:
            return None
        return read_all(self.source.location, self.source.compression)


def open_reader(source: InputFile, options: ReadOptions) -> DocumentReader:
    """The reader of `source`'s format."""
    from .jsonl import JsonlReader
    from .parquet import ParquetReader
    from .text import TextReader

    kinds = {"text": TextReader, "jsonl": JsonlReader, "parquet": ParquetReader}
    return kinds[source.format](source, options)
