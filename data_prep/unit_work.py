"""One work unit's shards: read its pieces, skip by reason, encode, split validation, pack and write.

Within a unit the validation documents are chosen exactly as for a whole corpus (prepare.choose_validation on the
documents' keys), each split is packed from the unit's own documents of that split (data_prep.packing: bestfit or
stream, each document framed BOS d EOS) and written as `{split}-{unit:06d}-{k:04d}.tar` whose members are numbered
by row within the unit (global offsets are assigned when the units are finalized).
"""
from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import Callable

import numpy as np

from .filters import skip_reason
from .manifest import file_sha256
from .packing import DEFAULT_PACK_BUFFER, make_packer, split_figures
from .prepare import SPLITS, choose_validation
from .readers import ReadOptions, open_reader
from .readers.fields import check_token_ids
from .remote_inputs import local_copy
from .stores import is_remote
from .shard_writer import SplitShardWriter, shard_name
from .units import WorkUnit


def unit_shard_name(split: str, unit: int, number: int) -> str:
    return f"{split}-{unit:06d}-{number:04d}.tar"


def read_unit_records(unit: WorkUnit, options: ReadOptions, inputs: dict | None = None):
    """The unit's records, in order; `inputs` gets the size and sha256 of each file whose first piece is here.
    A remote file (one piece) is read from a downloaded copy, all of it."""
    for piece_range in unit.ranges:
        with local_copy(piece_range.file, options.s3_endpoint) as source:
            if inputs is not None and piece_range.first == 0:
                inputs[piece_range.file.name] = {"size": piece_range.file.size, "sha256": file_sha256(source.location)}
            stop = None if is_remote(piece_range.file.location) else piece_range.stop
            yield from open_reader(source, options).read(piece_range.first, stop)


def write_unit(unit: WorkUnit, out: Path, options: ReadOptions, encode: Callable[[str], np.ndarray] | None,
               specials: tuple[int, int, int], vocab_size: int, seq_len: int, shard_size: int,
               val_fraction: float, dtype, min_chars: int = 0, filters: tuple = (), packing: str = "stream",
               pack_buffer: int = DEFAULT_PACK_BUFFER) -> dict:
    """Write the unit's shards into `out`; returns its summary (rows, tokens, documents, skips, shards and packing
    figures per split, and the size and sha256 of each input file whose first piece is in this unit). Each split's
    last row: dropped when incomplete (stream), padded (bestfit: the buffer is drained at the unit's end)."""
    skipped: Counter = Counter()
    docs, inputs = [], {}
    for record in read_unit_records(unit, options, inputs):
        reason = record.skip_reason or skip_reason(record.text if record.tokens is None else None, record.meta,
                                                   min_chars, filters, record.key)
        if reason:
            skipped[reason] += 1
            continue
        if record.tokens is not None:
            check_token_ids(record.tokens, vocab_size, record.key)
            tokens = np.asarray(record.tokens, dtype=dtype)
        else:
            tokens = encode(record.text)
        docs.append((record.key, tokens))
    # a unit of one document (a single large text file) holds no validation document: the split needs two
    val_keys = choose_validation([key for key, _ in docs], val_fraction) if val_fraction > 0 and len(docs) > 1 \
        else set()
    bos, eos, pad = specials
    summary = {"documents": len(docs), "skipped_by_reason": dict(sorted(skipped.items())), "splits": {},
               "bytes": unit.size, "inputs": inputs}
    for split in SPLITS:
        packer = make_packer(packing, seq_len + 1, bos, eos, pad, dtype, pack_buffer)
        staging = out / f".{split}"
        staging.mkdir()
        writer = SplitShardWriter(staging, split, shard_size, seq_len + 1, dtype)
        for key, tokens in docs:
            if (key in val_keys) == (split == "val"):
                writer.add_rows(packer.add_document(tokens))
        rows, _, dropped = packer.finish(keep_partial=False)
        writer.add_rows(rows)  # stream: none; bestfit: the drained buffer's rows, the last one padded
        shards = writer.close()
        for number, shard in enumerate(shards):
            shard["name"] = unit_shard_name(split, unit.index, number)
            os.replace(staging / shard_name(split, number), out / shard["name"])
        staging.rmdir()
        summary["splits"][split] = {"rows": writer.rows_written, "documents": packer.documents,
                                    "stream_tokens": packer.stream_tokens, "dropped_tail_tokens": dropped,
                                    **split_figures(packer), "shards": shards}
    return summary

