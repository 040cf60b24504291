"""`python -m data_prep synth`: a synthetic reasoning dataset (data_prep.synth_tasks) as ordinary megaloop shards,
with the place and difficulty of every answer beside them.

The output directory holds what `python -m data_prep shards` writes, so `megaloop train` reads it unchanged:

    train-000000.tar ...  val-000000.tar ...   rows of seq_len + 1 tokens (data_prep.shard_writer)
    tokenizer/                                  the task's word-level tokenizer: its fixed vocabulary
    synth-train.npy  synth-val.npy              int32 [queries, 3]: row, position, hops, sorted by row then position;
                                                the answer is row[position], predicted from the logits at position - 1
    manifest.json                               the usual fields, and "synth": the task, the hops range and the
                                                query files with their sha256

Determinism: train row i is made by numpy's Generator seeded with (seed, 0, i), val row i by (seed, 1, i, attempt),
a separate key stream; the same options give the same bytes. A val row whose context (the khop table) equals any
train row's is drawn again with the next attempt, so every val table is unseen in training. A task without a
context (modarith) has nothing to hold out but its draws: short val queries also occur in train.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import __version__
from .errors import DataPrepError
from .manifest import FORMAT, FORMAT_VERSION, file_sha256, write_manifest
from .prepare import TOKENIZER_SUBDIR, prepare_output_dir, publish_outputs
from .shard_writer import SplitShardWriter
from .synth_tasks import BOS_ID, EOS_ID, PAD_ID, SPECIAL_TOKENS, TASKS
from .tokenizer import CONFIG_FILE, TOKENIZER_FILE, tokenizer_hash

STREAMS = {"train": 0, "val": 1}
QUERY_COLUMNS = ("row", "position", "hops")
MAX_ATTEMPTS = 1000  # draws of one val row before the train rows are declared to hold (nearly) every table


@dataclass
class SynthOptions:
    """What `data_prep synth` makes: `rows` train and `val_rows` val rows of `task`, seq_len + 1 tokens each."""

    task: str
    hops: tuple[int, int]
    rows: int = 8192
    val_rows: int = 512
    seed: int = 0
    seq_len: int = 128
    shard_size: int = 8192
    overwrite: bool = False

    def recorded(self) -> dict:
        """The options that shape the output, as stored in the manifest's parameters."""
        return {"task": self.task, "hops": list(self.hops), "rows": self.rows, "val_rows": self.val_rows,
                "seed": self.seed, "seq_len": self.seq_len, "shard_size": self.shard_size}


def task_named(name: str):
    """The task called `name`, or a one-line error naming the known ones."""
    if name not in TASKS:
        raise DataPrepError(f"--task {name!r} is not a synthetic task", f"use one of {', '.join(sorted(TASKS))}")
    return TASKS[name]


def parse_hops(text: str | None, task) -> tuple[int, int]:
    """`A..B` (or `A`) as (A, B), 1 <= A <= B <= the task's max_hops; None: (1, 4) capped by max_hops."""
    if text is None:
        return 1, min(4, task.max_hops)
    parts = text.split("..")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, -1)
    except ValueError:
        low, high = 0, -1
    if not 1 <= low <= high <= task.max_hops:
        raise DataPrepError(f"--hops {text!r} is not a range A..B with 1 <= A <= B <= {task.max_hops} for "
                            f"{task.name}", "pass e.g. --hops 1..4 (or one count, --hops 2)")
    return low, high


def check_options(options: SynthOptions) -> None:
    """Counts are positive and a row holds the context and one query of the most hops asked for."""
    task = task_named(options.task)
    for flag, value in (("--rows", options.rows), ("--val-rows", options.val_rows),
                        ("--seq-len", options.seq_len), ("--shard-size", options.shard_size)):
        if value < 1:
            raise DataPrepError(f"{flag} must be at least 1, got {value}", f"pass a positive {flag}")
    need = 1 + task.context_tokens() + task.max_query_tokens(options.hops[1])
    if need > options.seq_len + 1:
        raise DataPrepError(f"a {task.name} row needs {need} tokens (BOS, the context and one query of "
                            f"{options.hops[1]} hops), more than seq_len + 1 = {options.seq_len + 1}",
                            f"pass --seq-len {need - 1} or more, or fewer --hops")


def make_row(task, options: SynthOptions, split: str, row: int, attempt: int = 0):
    """Row `row` of `split` (a synth_tasks.Row), from its own key (see the module docstring)."""
    key = [options.seed, STREAMS[split], row] + ([attempt] if split == "val" else [])
    return task.row(np.random.default_rng(key), options.hops, options.seq_len + 1)


def make_split(task, options: SynthOptions, split: str, seen: set | None = None):
    """(tokens [rows, seq_len + 1] uint16, queries [Q, 3] int32, the context keys) of one split; a row whose key is
    in `seen` is drawn again."""
    count = options.rows if split == "train" else options.val_rows
    rows, queries, keys = [], [], set()
    for i in range(count):
        row = make_row(task, options, split, i)
        attempt = 0
        while seen and row.key is not None and row.key in seen:
            attempt += 1
            if attempt == MAX_ATTEMPTS:
                tables = task.parameters().get("distinct_tables")
                raise DataPrepError(f"val row {i}: {MAX_ATTEMPTS} draws all gave a table used in train ({task.name} "
                                    f"has {tables} distinct tables, {options.rows} train rows hold nearly all)",
                                    f"pass fewer --rows (e.g. {tables // 2}), or a task of longer tables")
            row = make_row(task, options, split, i, attempt)
        rows.append(row.tokens)
        queries.append(np.stack([np.full(len(row.positions), i), row.positions, row.hops], axis=1))
        keys.add(row.key)
    return np.stack(rows), np.concatenate(queries).astype(np.int32), keys


def build_tokenizer(task) -> str:
    """tokenizer.json of the task's word-level tokenizer: one token per whitespace-separated word, the specials
    <|bos|>=0 <|eos|>=1 <|pad|>=2 (and <|unk|>=3 for words outside the vocabulary)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(task.vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS[3]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok.to_str()


def write_tokenizer(task, directory: Path) -> dict:
    """Write the task's tokenizer directory (as data_prep.tokenizer.load_tokenizer reads it); returns its config."""
    tokenizer_json = build_tokenizer(task)
    vocab = task.vocabulary()
    config = {"format": "megaloop-data_prep-tokenizer", "format_version": 1, "data_prep_version": __version__,
              "kind": "word-level", "task": task.name, "vocab_size": len(vocab),
              "special_tokens": {t: vocab.index(t) for t in SPECIAL_TOKENS}, "hash": tokenizer_hash(tokenizer_json)}
    directory.mkdir(parents=True)
    (directory / TOKENIZER_FILE).write_text(tokenizer_json, encoding="utf-8")
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return config


def write_split(staging: Path, split: str, tokens: np.ndarray, queries: np.ndarray, shard_size: int) -> dict:
    """The split's shards and query file in `staging`; returns its manifest entry (splits[split])."""
    writer = SplitShardWriter(staging, split, shard_size, tokens.shape[1], np.uint16)
    writer.add_rows(tokens)
    shards = writer.close()
    padded = int((tokens == PAD_ID).sum())
    return {"rows": len(tokens), "tokens": int(tokens.size), "stream_tokens": int(tokens.size - padded),
            "documents": len(tokens), "padded_tokens": padded, "dropped_tail_tokens": 0, "shards": shards}


def write_queries(staging: Path, split: str, queries: np.ndarray) -> dict:
    """synth-{split}.npy; returns its manifest entry."""
    path = staging / f"synth-{split}.npy"
    np.save(path, queries, allow_pickle=False)
    return {"file": path.name, "queries": len(queries), "sha256": file_sha256(path)}


def synth_manifest(task, options: SynthOptions, tok_config: dict, splits: dict, query_files: dict) -> dict:
    """manifest.json: the fields of a `data_prep shards` manifest (no text sources) and the "synth" entry."""
    counts = {"files_listed": 0, "files_used": 0, "files_skipped": 0, "skipped_by_reason": {}, "text_bytes": 0,
              "replaced_bytes": 0, "files_with_replaced_bytes": 0}
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "data_prep_version": __version__,
        "seq_len": options.seq_len, "row_len": options.seq_len + 1, "dtype": "uint16",
        "member_format": "{row:010d}.npy",
        "tokenizer": {"hash": tok_config["hash"], "vocab_size": tok_config["vocab_size"], "bos_id": BOS_ID,
                      "eos_id": EOS_ID, "pad_id": PAD_ID, "encoder": "hf",
                      "encoder_check": "word-level tokenizer: encoded by HF tokenizers", "copy": TOKENIZER_SUBDIR},
        "parameters": options.recorded(), "splits": splits, "counts": counts,
        "rows": sum(s["rows"] for s in splits.values()), "tokens": sum(s["tokens"] for s in splits.values()),
        "sources": [],
        "synth": {"task": task.name, "task_parameters": task.parameters(), "hops": list(options.hops),
                  "columns": list(QUERY_COLUMNS), "queries": query_files,
                  "answer": "the token at row[position], predicted from the logits at position - 1"},
    }


def write_synth(out_dir, options: SynthOptions) -> dict:
    """Make the dataset in `out_dir` (staged, then published whole: a failure leaves the directory as it was);
    returns the manifest."""
    check_options(options)
    task = task_named(options.task)
    out_dir = Path(out_dir)
    staging = prepare_output_dir(out_dir, options.overwrite)
    try:
        splits, query_files, train_keys = {}, {}, None
        for split in ("train", "val"):
            tokens, queries, keys = make_split(task, options, split, train_keys)
            train_keys = keys if split == "train" else train_keys
            splits[split] = write_split(staging, split, tokens, queries, options.shard_size)
            query_files[split] = write_queries(staging, split, queries)
        tok_config = write_tokenizer(task, staging / TOKENIZER_SUBDIR)
        manifest = synth_manifest(task, options, tok_config, splits, query_files)
        write_manifest(staging, manifest)
    except BaseException:
        import shutil

        shutil.rmtree(staging, ignore_errors=True)
        raise
    publish_outputs(staging, out_dir)
    return manifest


def read_queries(shard_dir, split: str) -> tuple[dict, np.ndarray]:
    """(the manifest's "synth" entry, the split's queries [Q, 3]: row, position, hops) of a synth dataset, checked
    against the sha256 the manifest records."""
    from .manifest import read_manifest

    manifest = read_manifest(shard_dir)
    info = manifest.get("synth")
    if not isinstance(info, dict) or split not in info.get("queries", {}):
        raise DataPrepError(f"{shard_dir} is not a synthetic dataset with a {split} split (its manifest has no "
                            "synth queries)", "make one with `python -m data_prep synth --task khop --out DIR`")
    entry = info["queries"][split]
    path = Path(shard_dir) / entry["file"]
    if not path.is_file() or file_sha256(path) != entry["sha256"]:
        raise DataPrepError(f"{path} is missing or differs from the file the manifest records",
                            "re-create the dataset with `python -m data_prep synth ... --overwrite`")
    return info, np.load(path, allow_pickle=False)
