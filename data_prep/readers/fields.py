"""Turning one row (a dict of fields) into a Record, with the same rules for JSON lines and parquet."""
from __future__ import annotations

from ..errors import DataPrepError
from .base import ReadOptions, Record

SKIP_NO_TEXT = "missing or empty text field"
SKIP_BAD_RECORD = "bad record"


def row_to_record(row: dict, key: str, options: ReadOptions, where: str) -> Record:
    """A Record from a row; a non-string text or non-integer token list is a bad record."""
    record = Record(str(row[options.id_field]) if options.id_field and row.get(options.id_field) is not None else key)
    record.meta = {name: row.get(name) for name in options.meta_fields}
    if options.tokens_field:
        tokens = row.get(options.tokens_field)
        if not isinstance(tokens, list) or not all(isinstance(t, int) and t >= 0 for t in tokens):
            return bad_record(record, f"{where}: field {options.tokens_field!r} is not a list of token ids", options)
        record.tokens = tokens
        if not tokens:
            record.skip_reason = SKIP_NO_TEXT
        return record
    text = row.get(options.text_field)
    if text is not None and not isinstance(text, str):
        return bad_record(record, f"{where}: field {options.text_field!r} is a {type(text).__name__}, not a string",
                          options)
    if not text:
        record.skip_reason = SKIP_NO_TEXT
        return record
    record.text = text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text
    return record


def bad_record(record: Record, problem: str, options: ReadOptions) -> Record:
    """Skip the record (--on-bad-record skip) or stop with the problem (error)."""
    if options.on_bad_record == "skip":
        record.skip_reason = SKIP_BAD_RECORD
        return record
    raise DataPrepError(problem, "fix the input, or pass --on-bad-record skip to skip such records")


def check_token_ids(tokens: list[int], vocab_size: int, where: str) -> None:
    """Pre-tokenized input: every id must be below the vocabulary size."""
    top = max(tokens, default=-1)
    if top >= vocab_size:
        raise DataPrepError(f"{where}: token id {top} is not below the vocabulary size {vocab_size}",
                            "pass the --vocab-size (or --tokenizer) the ids were made with")
