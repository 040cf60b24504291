"""How documents become rows: the two packing modes and the record of what packing cost.

Every document is framed as BOS text EOS; rows hold row_len = seq_len + 1 tokens (inputs and shifted labels).

- `stream` (shard_writer.RowPacker; what data_prep wrote before packing was recorded): the framed documents are
  joined into one stream cut at fixed offsets, so documents span rows and most rows start mid-document; only the
  split's final incomplete row is dropped (or padded with --keep-last-partial).
- `bestfit` (BestFitPacker; the published runs' BOS-aligned best fit): framed documents wait in a buffer of
  `buffer` documents. A row is filled by repeatedly taking the longest buffered document that still fits in its
  remaining space; when none fits, the shortest buffered one is cut to fill the row exactly and the rest of it is
  dropped (never carried to another row). A document longer than a row thus keeps at most a row. Each choice is
  made from a full buffer; at the end of a split (of a work unit) the buffer is drained the same way and only the
  very last row, when the buffer runs dry before it is full, is padded with PAD. So every row starts at a
  document's BOS and no document spans two rows. Ties between equal lengths go to the document buffered first,
  so the rows are a pure function of the documents' order.

A packer reports, per split: `dropped_tokens` (tokens of the documents that did not make it into a row),
`padded_tokens` and `cut_documents` (documents that lost tokens). Then stream_tokens = rows x row_len -
padded_tokens + dropped_tokens.
"""
from __future__ import annotations

from bisect import bisect_right
from collections import deque

import numpy as np

PACKING_MODES = ("bestfit", "stream")
CLI_DEFAULT_PACKING = "bestfit"  # `data_prep shards`; the Python API's default stays stream (what callers got)
DEFAULT_PACK_BUFFER = 1000
SPLIT_FIGURES = ("dropped_tokens", "padded_tokens", "cut_documents")


def frame(tokens: np.ndarray, bos_id: int, eos_id: int, dtype) -> np.ndarray:
    """BOS tokens EOS as one array of `dtype`."""
    framed = np.empty(len(tokens) + 2, dtype=dtype)
    framed[0], framed[-1] = bos_id, eos_id
    framed[1:-1] = tokens
    return framed


class BestFitPacker:
    """BOS-aligned best-fit packing of one split (see the module docstring). Same interface as RowPacker:
    add_document(tokens) -> completed rows, finish() -> (last rows, padded tokens, 0)."""

    def __init__(self, row_len: int, bos_id: int, eos_id: int, pad_id: int, dtype, buffer: int = DEFAULT_PACK_BUFFER):
        if buffer < 1:
            raise ValueError(f"the pack buffer must hold at least 1 document, got {buffer}")
        self.row_len, self.bos_id, self.eos_id, self.pad_id = row_len, bos_id, eos_id, pad_id
        self.dtype, self.buffer = dtype, buffer
        self.stream_tokens = self.documents = 0
        self.dropped_tokens = self.padded_tokens = self.cut_documents = 0
        self._lengths: list[int] = []  # framed lengths of the buffered documents, sorted
        self._by_length: dict[int, deque] = {}  # length -> its buffered documents, oldest first
        self._row = np.empty(row_len, dtype=dtype)
        self._filled = 0

    def add_document(self, tokens: np.ndarray) -> np.ndarray:
        """Buffer one document (tokens without BOS/EOS); returns the rows completed meanwhile, [n, row_len]."""
        framed = frame(tokens, self.bos_id, self.eos_id, self.dtype)
        self.stream_tokens += len(framed)
        self.documents += 1
        index = bisect_right(self._lengths, len(framed))
        self._lengths.insert(index, len(framed))
        self._by_length.setdefault(len(framed), deque()).append(framed)
        rows = []
        while len(self._lengths) >= self.buffer:
            rows.extend(self._place_one())
        return self._stack(rows)

    def finish(self, keep_partial: bool = True) -> tuple[np.ndarray, int, int]:
        """Drain the buffer into rows; the last row is padded when the documents run out before it is full
        (`keep_partial` is for the stream packer: best fit always keeps that row). Returns (rows, padded, 0)."""
        rows = []
        while self._lengths:
            rows.extend(self._place_one())
        padded = 0
        if self._filled:
            padded = self.row_len - self._filled
            self._row[self._filled:] = self.pad_id
            self._filled = self.row_len
            rows.append(self._take_row())
        self.padded_tokens += padded
        return self._stack(rows), padded, 0

    def _place_one(self) -> list[np.ndarray]:
        """Put one buffered document into the current row: the longest that fits, else the shortest cut to fill
        the row. Returns [the row] when it is full, else []."""
        space = self.row_len - self._filled
        index = bisect_right(self._lengths, space) - 1
        cut = index < 0
        length = self._lengths.pop(0 if cut else index)
        queue = self._by_length[length]
        document = queue.popleft()
        if not queue:
            del self._by_length[length]
        take = space if cut else length
        if cut:
            self.dropped_tokens += length - space
            self.cut_documents += 1
        self._row[self._filled:self._filled + take] = document[:take]
        self._filled += take
        return [self._take_row()] if self._filled == self.row_len else []

    def _take_row(self) -> np.ndarray:
        row, self._row, self._filled = self._row, np.empty(self.row_len, dtype=self.dtype), 0
        return row

    def _stack(self, rows: list[np.ndarray]) -> np.ndarray:
        return np.stack(rows) if rows else np.empty((0, self.row_len), dtype=self.dtype)


def check_packing(packing: str, pack_buffer: int) -> None:
    """Reject a packing mode or buffer that cannot work, before any work starts."""
    from .errors import DataPrepError

    if packing not in PACKING_MODES:
        raise DataPrepError(f"--packing must be one of {', '.join(PACKING_MODES)}, got {packing!r}",
                            "pass --packing bestfit or --packing stream")
    if isinstance(pack_buffer, bool) or not isinstance(pack_buffer, int) or pack_buffer < 1:
        raise DataPrepError(f"--pack-buffer must be at least 1 document, got {pack_buffer}",
                            f"pass e.g. --pack-buffer {DEFAULT_PACK_BUFFER} (the documents best fit chooses among)")


def make_packer(mode: str, row_len: int, bos_id: int, eos_id: int, pad_id: int, dtype,
                buffer: int = DEFAULT_PACK_BUFFER):
    """The packer of one split under `mode` ("bestfit" or "stream")."""
    from .shard_writer import RowPacker

    if mode == "bestfit":
        return BestFitPacker(row_len, bos_id, eos_id, pad_id, dtype, buffer)
    if mode == "stream":
        return RowPacker(row_len, bos_id, eos_id, pad_id, dtype)
    raise ValueError(f"unknown packing mode {mode!r}; use one of {PACKING_MODES}")


def split_figures(packer) -> dict:
    """A finished packer's packing figures (SPLIT_FIGURES)."""
    return {name: int(getattr(packer, name)) for name in SPLIT_FIGURES}


def packing_record(mode: str, buffer: int | None, splits: dict) -> dict:
    """The manifest's `packing` entry: the mode, its buffer (None for stream), that documents are framed BOS..EOS
    (bos_framed) and whether every row starts at a document's BOS, with the figures per split and in total.
    `splits`: {split: its SPLIT_FIGURES}."""
    per_split = {split: {name: int(figures[name]) for name in SPLIT_FIGURES} for split, figures in splits.items()}
    totals = {name: sum(f[name] for f in per_split.values()) for name in SPLIT_FIGURES}
    return {"mode": mode, "buffer": buffer if mode == "bestfit" else None, "bos_framed": True,
            "rows_start_at_bos": mode == "bestfit", **totals, "splits": per_split}


def describe_packing(record: dict, stream_tokens: int | None = None) -> str:
    """One line: the mode and what it cost, e.g. `packing bestfit (buffer 1000): 1,234 tokens dropped (2.1%) ...`."""
    mode = record["mode"] + (f" (buffer {record['buffer']})" if record.get("buffer") else "")
    if not record.get("recorded", True):
        mode += " (not recorded: made before packing was)"
    dropped = f"{record['dropped_tokens']:,} tokens dropped"
    if stream_tokens:
        dropped += f" ({record['dropped_tokens'] / stream_tokens:.1%})"
    cut = "" if record.get("cut_documents") is None else f", {record['cut_documents']:,} documents cut"
    starts = "every row starts at a document's BOS" if record.get("rows_start_at_bos") else "rows start anywhere"
    return f"packing {mode}: {dropped}, {record['padded_tokens']:,} pad tokens{cut}; {starts}"


def units_packing_record(options: dict, summaries: list[dict]) -> dict:
    """The `packing` entry of a dataset finalized from work units: `options` the recorded ones (a prep from before
    packing was recorded: stream), `summaries` the units' (their figures summed per split)."""
    splits = {}
    for summary in summaries:
        for split, info in summary["splits"].items():
            into = splits.setdefault(split, dict.fromkeys(SPLIT_FIGURES, 0))
            for name in SPLIT_FIGURES:
                into[name] += info.get(name, 0)
    return packing_record(options.get("packing", "stream"), options.get("pack_buffer"), splits)


def split_summary(manifest: dict, split: str) -> str:
    """`N tokens dropped, N padded, N documents cut` of one split of a manifest with a packing record."""
    figures = manifest["packing"]["splits"][split]
    return (f"{figures['dropped_tokens']} tokens dropped, {figures['padded_tokens']} padded, "
            f"{figures['cut_documents']} documents cut")


def summary_lines(manifest: dict) -> list[str]:
    """The packing line of a `shards` summary, and a note when best fit dropped most of the text."""
    packing = manifest["packing"]
    stream_tokens = sum(info["stream_tokens"] for info in manifest["splits"].values())
    lines = [describe_packing(packing, stream_tokens)]
    if packing["mode"] == "bestfit" and packing["dropped_tokens"] > 0.5 * stream_tokens:
        lines.append(f"note: best fit dropped {packing['dropped_tokens'] / stream_tokens:.1%} of the tokens: most "
                     f"documents are longer than a row of {manifest['row_len']} tokens and keep one row each; for a "
                     "corpus of long documents (books) pass --packing stream, or a longer --seq-len")
    return lines
