"""Loss and bits per byte at fixed depths T on the validation split and on any text, with bootstrap intervals.

Rows are scored as the trainer's validation scores them (megaloop.train.evaluate): inputs tokens[:-1], labels
tokens[1:], h_0 keyed (seed, -1, row index), the same T for every row. A text (a file, or every file of a
directory) is scored document by document: BOS + the document's tokens, cut into rows of seq_len + 1 tokens that
overlap by one (each token predicted once; a row's first token is its only context from the row before); the last
row of a document is padded and its padding carries no label.

Bits per byte divide the summed loss (nats / ln 2) by the bytes of the text (UTF-8, counted from the files
themselves) or, for the validation split, by its tokens times the manifest's bytes per token. The interval is a
percentile bootstrap over rows (the loss as a ratio of summed nats to summed tokens, 1000 resamples, seeded); the
bits-per-byte interval is the loss interval scaled by the same tokens-per-byte factor (the byte count of a fixed
text is not random).
"""
from __future__ import annotations

import contextlib

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from megaloop.eval.checkpoint import EvalInputError
from megaloop.eval.world import World

VAL_NOISE_STEP = -1  # the trainer's validation key (megaloop.train.evaluate.VAL_NOISE_STEP)
BOOTSTRAP_SAMPLES = 1000


@dataclass
class Rows:
    """Rows to score: tokens [N, seq_len + 1], labelled [N, seq_len] (False: padding), the h_0 key's row index [N]."""

    tokens: torch.Tensor
    labelled: torch.Tensor
    index: torch.Tensor
    bytes: float | None = None  # bytes of text these rows hold (None: unknown)


def validation_rows(shards, limit: int | None = None) -> tuple[Rows, float | None]:
    """The validation split's rows in order (the first `limit`), and its bytes per token (None: unknown)."""
    from data_prep.shard_reader import ShardDataset

    try:
        ds = ShardDataset(shards, "val", verify="none")
    except Exception as err:  # noqa: BLE001 - a missing or damaged shard directory, whatever the reader says
        raise EvalInputError(f"{shards}: no validation split to evaluate ({err}); pass --shards DIR, or leave val out of --tasks") from None
    n = len(ds) if limit is None else min(limit, len(ds))
    tokens = torch.from_numpy(ds.read_rows(np.arange(n, dtype=np.int64)).astype(np.int64))
    from megaloop.train.data import _bytes_per_token
    from megaloop.train.labels import next_token_labels

    bpt = _bytes_per_token(ds.manifest, "val")
    pad_id = ds.manifest["tokenizer"].get("pad_id")  # a padded row's padding carries no label, as in training
    rows = Rows(tokens, next_token_labels(tokens, pad_id) != -100, torch.arange(n))
    rows.bytes = bpt * float(rows.labelled.sum()) if bpt else None
    return rows, bpt


def text_documents(path) -> list[str]:
    """A file is one document; a directory gives each of its files (sorted, recursively) as one document."""
    path = Path(path)
    if not path.exists():
        raise EvalInputError(f"--text {path}: no such file or directory; give a text file or a directory of them")
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    docs = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise EvalInputError(f"--text {path}: holds no text; give a non-empty text file or directory")
    return docs


def text_rows(docs: list[str], tokenizer, seq_len: int) -> Rows:
    chunks, labelled = [], []
    for doc in docs:
        ids = [tokenizer.bos_id, *tokenizer.encode(doc)]
        for start in range(0, len(ids) - 1, seq_len):
            piece = ids[start:start + seq_len + 1]
            n = len(piece) - 1
            chunks.append(piece + [tokenizer.pad_id] * (seq_len + 1 - len(piece)))
            labelled.append([True] * n + [False] * (seq_len - n))
    rows = Rows(torch.tensor(chunks), torch.tensor(labelled), torch.arange(len(chunks)))
    rows.bytes = float(sum(len(d.encode("utf-8")) for d in docs))
    return rows


@torch.no_grad()
def row_losses(model, rows: Rows, depth: int, seed: int, batch_size: int = 16, world: World | None = None,
               autocast=contextlib.nullcontext) -> tuple[np.ndarray, np.ndarray]:
    """Per-row summed nats and labelled tokens at depth `depth` (gathered over the world, in row order); each
    forward runs under `autocast()` (the trainer's precision)."""
    world = world or World()
    device = next(model.parameters()).device
    starts = list(range(0, len(rows.tokens), batch_size))
    out: dict[int, tuple[float, int]] = {}
    for b in world.mine(len(starts)):
        sl = slice(starts[b], starts[b] + batch_size)
        tokens, labelled, index = rows.tokens[sl].to(device), rows.labelled[sl].to(device), rows.index[sl]
        labels = tokens[:, 1:].masked_fill(~labelled, -100)
        with autocast():
            logits = model(tokens[:, :-1], depth=depth, noise_key=(seed, VAL_NOISE_STEP, index)).logits
        nats = F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=-100, reduction="none")
        for i, (s, c) in enumerate(zip(nats.double().sum(1).tolist(), labelled.sum(1).tolist())):
            out[starts[b] + i] = (s, c)
    out = world.gather(out)
    sums = np.array([out[i][0] for i in range(len(rows.tokens))])
    counts = np.array([out[i][1] for i in range(len(rows.tokens))], dtype=np.float64)
    return sums, counts


def bootstrap_ratio(sums: np.ndarray, counts: np.ndarray, seed: int = 0, samples: int = BOOTSTRAP_SAMPLES,
                    level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of sum(sums) / sum(counts) over rows resampled with replacement."""
    if len(sums) < 2:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(sums), size=(samples, len(sums)))
    ratios = sums[picks].sum(1) / np.maximum(counts[picks].sum(1), 1)
    tail = (1 - level) / 2 * 100
    return float(np.percentile(ratios, tail)), float(np.percentile(ratios, 100 - tail))


def evaluate_depths(model, rows: Rows, depths, seed: int, batch_size: int = 16, world: World | None = None,
                    progress=None, autocast=contextlib.nullcontext) -> dict[int, dict]:
    """{T: {"loss", "bpb", "ci_low", "ci_high", "bpb_ci_low", "bpb_ci_high", "tokens"}} (bpb NaN when the bytes
    are unknown)."""
    results = {}
    for depth in depths:
        sums, counts = row_losses(model, rows, depth, seed, batch_size, world, autocast)
        tokens = counts.sum()
        loss = float(sums.sum() / tokens) if tokens else float("nan")
        low, high = bootstrap_ratio(sums, counts, seed)
        per_byte = tokens / rows.bytes / math.log(2) if rows.bytes else float("nan")
        results[int(depth)] = {"loss": loss, "bpb": loss * per_byte, "ci_low": low, "ci_high": high,
                               "bpb_ci_low": low * per_byte, "bpb_ci_high": high * per_byte, "tokens": int(tokens)}
        if progress is not None:
            progress.update(1)
    return results
