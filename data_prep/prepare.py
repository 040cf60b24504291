"""Text directory -> tokenized, packed webdataset shards + manifest.json.

The work is split into a plan (list files, cheap skip checks, the validation split, the encoder choice), encoding
(one file = one document, done by local worker processes and/or MPI ranks, any order) and assembly (documents are
consumed strictly in file order, packed into rows and written by one process). Only the plan and the file order
decide the output, so it is byte-identical whatever the number of workers or ranks.

Validation split: by document. n_val = round(val_fraction * n_documents) (at least one when val_fraction > 0, at
most n - 1); the documents chosen are those with the smallest sha256("data_prep-val-split:" + relative path), so the
choice depends only on file names.
"""
from __future__ import annotations

import hashlib
import multiprocessing
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from . import __version__
from .errors import DataPrepError, EmptyCorpusError, NotEnoughTokensError
from .manifest import FORMAT, FORMAT_VERSION, MANIFEST_FILE, write_manifest
from .packing import DEFAULT_PACK_BUFFER, check_packing, make_packer, packing_record, split_figures
from .shard_writer import SplitShardWriter
from .text_io import (DEFAULT_MAX_INVALID_FRACTION, SourceFile, list_source_files, probe_skip_reason,
                      read_document)
from .tokenizer import TrainedTokenizer, copy_tokenizer_files, load_tokenizer

SPLITS = ("train", "val")
VAL_SPLIT_SALT = "data_prep-val-split:"
CORPUS_CHECK_DOCS = 8
CORPUS_CHECK_CHARS = 16384
TOKENIZER_SUBDIR = "tokenizer"
STAGING_SUBDIR = ".incoming"  # hidden: readers and a later --input walk never see it


@dataclass
class ShardOptions:
    """Creation parameters of a shard directory (all recorded in the manifest except the execution ones)."""

    seq_len: int
    shard_size: int = 8192
    val_fraction: float = 0.01
    keep_last_partial: bool = False
    glob: str = "*"
    encoder: str = "auto"
    max_invalid_fraction: float = DEFAULT_MAX_INVALID_FRACTION
    packing: str = "stream"  # data_prep.packing; `data_prep shards` defaults to bestfit, this API keeps stream
    pack_buffer: int = DEFAULT_PACK_BUFFER
    # execution only: these never change the output
    workers: int = 1
    overwrite: bool = False
    progress: bool = True

    def recorded(self) -> dict:
        """The options that shape the output, as stored in the manifest."""
        skip = {"workers", "overwrite", "progress"}
        return {k: v for k, v in asdict(self).items() if k not in skip}

    def validate(self) -> None:
        """Reject impossible values before any work starts."""
        if self.seq_len < 1:
            raise DataPrepError(f"--seq-len must be at least 1, got {self.seq_len}", "pass a positive --seq-len")
        if self.shard_size < 1:
            raise DataPrepError(f"--shard-size must be at least 1 row, got {self.shard_size}",
                                "pass a positive --shard-size")
        if not 0.0 <= self.val_fraction < 1.0:
            raise DataPrepError(f"--val-fraction must be in [0, 1), got {self.val_fraction}",
                                "pass e.g. --val-fraction 0.01")
        if not 0.0 <= self.max_invalid_fraction <= 1.0:
            raise DataPrepError(f"--max-invalid-fraction must be in [0, 1], got {self.max_invalid_fraction}",
                                "pass e.g. --max-invalid-fraction 0.1")
        if self.workers < 1:
            raise DataPrepError(f"--workers must be at least 1, got {self.workers}", "pass --workers 1 or more")
        check_packing(self.packing, self.pack_buffer)


@dataclass
class CorpusPlan:
    """What will be encoded: every listed file, the split of each, and files skipped before reading."""

    input_dir: str
    sources: list[SourceFile]
    splits: list[str | None]
    pre_skipped: dict[int, str]
    encoder: str
    encoder_check: str

    def tasks(self) -> list[int]:
        """Indices of the files to encode."""
        return [i for i in range(len(self.sources)) if i not in self.pre_skipped]


@dataclass
class EncodedDocument:
    """One file after reading and encoding (tokens is None when the file was skipped)."""

    index: int
    relpath: str
    size: int
    sha256: str
    replaced_bytes: int
    skip_reason: str | None
    tokens: np.ndarray | None


def choose_validation(relpaths: list[str], val_fraction: float) -> set[str]:
    """The relative paths held out for validation (see the module docstring)."""
    count = len(relpaths)
    if val_fraction <= 0 or count == 0:
        return set()
    if count < 2:
        raise DataPrepError("a validation split needs at least 2 usable documents, the input has 1",
                            "add documents or pass --val-fraction 0")
    n_val = min(max(1, round(val_fraction * count)), count - 1)
    keyed = sorted(relpaths, key=lambda p: hashlib.sha256((VAL_SPLIT_SALT + p).encode("utf-8", "surrogateescape"))
                   .hexdigest())
    return set(keyed[:n_val])


def _check_fast_encoder_on_corpus(tok: TrainedTokenizer, input_dir, sources, indices, options) -> tuple[str, str]:
    """Encoder decision: the fast one only when it also matches HF on the start of the first documents."""
    if tok.fast is None:
        return "hf", f"fast encoder not used: {tok.fast_problem or 'hf requested'}"
    texts = []
    for i in indices[:CORPUS_CHECK_DOCS]:
        doc = read_document(input_dir, sources[i], options.max_invalid_fraction)
        if doc.text:
            texts.append(doc.text[:CORPUS_CHECK_CHARS])
    problem = tok.verify_fast_encoder(texts)
    if problem is None:
        return "tiktoken", f"tiktoken ids equal HF ids on the built-in sample and {len(texts)} corpus documents"
    if options.encoder == "tiktoken":
        raise DataPrepError(f"the fast encoder disagrees with HF on the corpus: {problem}", "use --encoder auto or hf")
    tok.fast, tok.fast_problem = None, problem
    return "hf", f"fast encoder disagrees with HF ({problem}); using HF"


def plan_corpus(input_dir, tok: TrainedTokenizer, options: ShardOptions) -> CorpusPlan:
    """List the input, skip empty/binary files, assign splits and choose the encoder (cheap, done once)."""
    sources = list_source_files(input_dir, options.glob)
    pre_skipped = {}
    for i, source in enumerate(sources):
        reason = probe_skip_reason(Path(input_dir) / source.relpath, source.size)
        if reason:
            pre_skipped[i] = reason
    usable = [i for i in range(len(sources)) if i not in pre_skipped]
    if not usable:
        raise EmptyCorpusError(f"{input_dir} holds no usable text file ({len(sources)} files, all skipped: "
                               f"{sorted(set(pre_skipped.values()))})", "point --input at UTF-8 text files")
    val = choose_validation([sources[i].relpath for i in usable], options.val_fraction)
    splits = [None if i in pre_skipped else ("val" if sources[i].relpath in val else "train")
              for i in range(len(sources))]
    if options.packing == "stream":  # best fit makes a (padded) row of any document
        _check_split_can_fill_a_row(sources, splits, options)
    encoder, check = _check_fast_encoder_on_corpus(tok, input_dir, sources, usable, options)
    return CorpusPlan(str(input_dir), sources, splits, pre_skipped, encoder, check)


def _check_split_can_fill_a_row(sources, splits, options: ShardOptions) -> None:
    """Fail early when a split cannot reach seq_len + 1 tokens. A token holds at least one byte of text, and an
    invalid byte becomes U+FFFD (3 bytes), so a file of n bytes gives at most n * (1 + 2 * max_invalid) + 2 tokens."""
    if options.keep_last_partial:
        return
    growth = 1 + 2 * options.max_invalid_fraction
    for split in SPLITS:
        members = [s for s, sp in zip(sources, splits) if sp == split]
        upper_bound = sum(int(s.size * growth) + 2 for s in members)
        if members and upper_bound < options.seq_len + 1:
            raise NotEnoughTokensError(
                f"the {split} split has at most {upper_bound} tokens ({len(members)} documents), fewer than "
                f"seq_len + 1 = {options.seq_len + 1} needed for one row",
                "lower --seq-len, add text, change --val-fraction, or pass --keep-last-partial")


# ----------------------------------------------------------------------------------------------- encoding

_WORKER_STATE: dict = {}


def init_encoder_process(tokenizer_dir: str, encoder: str, input_dir: str, max_invalid_fraction: float) -> None:
    """Pool initializer: load the tokenizer once per worker process."""
    tok = load_tokenizer(tokenizer_dir, encoder=encoder, verify=False)   # the parent has verified it
    _WORKER_STATE.update(tok=tok, input_dir=input_dir, max_invalid=max_invalid_fraction)


def encode_with(tok: TrainedTokenizer, input_dir, index: int, source: SourceFile,
                max_invalid_fraction: float) -> EncodedDocument:
    """Read one file and encode it (no BOS/EOS)."""
    doc = read_document(input_dir, source, max_invalid_fraction)
    tokens = None if doc.skip_reason else tok.encode_to_array(doc.text)
    return EncodedDocument(index, doc.relpath, doc.size, doc.sha256, doc.replaced_bytes, doc.skip_reason, tokens)


def encode_task(task: tuple[int, SourceFile]) -> EncodedDocument:
    """Worker entry point: encode one (index, source) with the process's tokenizer."""
    index, source = task
    return encode_with(_WORKER_STATE["tok"], _WORKER_STATE["input_dir"], index, source, _WORKER_STATE["max_invalid"])


def iter_encoded(plan: CorpusPlan, indices: list[int], tokenizer_dir, workers: int, max_invalid_fraction: float,
                 tok: TrainedTokenizer | None = None):
    """EncodedDocuments for `indices`, in that order, using `workers` processes (in-process when 1)."""
    tasks = [(i, plan.sources[i]) for i in indices]
    if workers <= 1 or len(tasks) <= 1:
        tok = tok or load_tokenizer(tokenizer_dir, encoder=plan.encoder, verify=False)
        for index, source in tasks:
            yield encode_with(tok, plan.input_dir, index, source, max_invalid_fraction)
        return
    context = multiprocessing.get_context("spawn")
    init_args = (str(tokenizer_dir), plan.encoder, plan.input_dir, max_invalid_fraction)
    with context.Pool(min(workers, len(tasks)), initializer=init_encoder_process, initargs=init_args) as pool:
        yield from pool.imap(encode_task, tasks, chunksize=1)


# ----------------------------------------------------------------------------------------------- assembly

@dataclass
class ShardAssembler:
    """Consumes EncodedDocuments in file order; packs each split into rows and writes its shards."""

    plan: CorpusPlan
    tok: TrainedTokenizer
    options: ShardOptions
    out_dir: Path
    sources_out: list = field(default_factory=list)
    _next_index: int = 0

    def __post_init__(self):
        dtype, row_len = self.tok.token_dtype, self.options.seq_len + 1
        self.packers = {s: make_packer(self.options.packing, row_len, self.tok.bos_id, self.tok.eos_id,
                                       self.tok.pad_id, dtype, self.options.pack_buffer) for s in SPLITS}
        self.writers = {s: SplitShardWriter(self.out_dir, s, self.options.shard_size, row_len, dtype)
                        for s in SPLITS}

    def _record(self, index: int, size: int, sha256: str | None, tokens: int, replaced: int, skipped) -> None:
        source = self.plan.sources[index]
        self.sources_out.append({"path": source.relpath, "size": size, "sha256": sha256,
                                 "split": self.plan.splits[index] if not skipped else None,
                                 "tokens": tokens, "replaced_bytes": replaced, "skipped": skipped})

    def _skip_listed_until(self, index: int) -> None:
        """Record the files skipped at planning time that come before `index`."""
        while self._next_index < index:
            i = self._next_index
            self._record(i, self.plan.sources[i].size, None, 0, 0, self.plan.pre_skipped[i])
            self._next_index += 1

    def add(self, doc: EncodedDocument) -> None:
        """Add the next document (must come in file order)."""
        self._skip_listed_until(doc.index)
        if doc.index != self._next_index:
            raise RuntimeError(f"documents out of order: got {doc.index}, expected {self._next_index}")
        self._next_index += 1
        if doc.skip_reason:
            self._record(doc.index, doc.size, doc.sha256, 0, doc.replaced_bytes, doc.skip_reason)
            return
        split = self.plan.splits[doc.index]
        self.writers[split].add_rows(self.packers[split].add_document(doc.tokens))
        self._record(doc.index, doc.size, doc.sha256, int(len(doc.tokens)), doc.replaced_bytes, None)

    def finish(self) -> dict:
        """Close all shards, check every split has rows, and return the manifest."""
        self._skip_listed_until(len(self.plan.sources))
        split_info = {}
        for split in SPLITS:
            rows, padded, dropped = self.packers[split].finish(self.options.keep_last_partial)
            self.writers[split].add_rows(rows)
            shards = self.writers[split].close()
            packer, n_rows = self.packers[split], self.writers[split].rows_written
            if packer.documents and n_rows == 0:
                raise NotEnoughTokensError(
                    f"the {split} split has {packer.stream_tokens} tokens in {packer.documents} documents, fewer "
                    f"than seq_len + 1 = {self.options.seq_len + 1} needed for one row",
                    "lower --seq-len, add text, change --val-fraction, or pass --keep-last-partial")
            split_info[split] = {"rows": n_rows, "tokens": n_rows * (self.options.seq_len + 1),
                                 "stream_tokens": packer.stream_tokens, "documents": packer.documents,
                                 "padded_tokens": padded, "dropped_tail_tokens": dropped, "shards": shards}
        for split, wanted in (("train", True), ("val", self.options.val_fraction > 0)):
            if wanted and split_info[split]["rows"] == 0:
                raise NotEnoughTokensError(f"the {split} split is empty (its documents were all skipped)",
                                           "check the skipped files, add documents or change --val-fraction")
        packing = packing_record(self.options.packing, self.options.pack_buffer,
                                 {s: split_figures(self.packers[s]) for s in SPLITS})
        return self._manifest(split_info, packing)

    def _manifest(self, split_info: dict, packing: dict) -> dict:
        skipped: dict[str, int] = {}
        for entry in self.sources_out:
            if entry["skipped"]:
                skipped[entry["skipped"]] = skipped.get(entry["skipped"], 0) + 1
        used = [e for e in self.sources_out if not e["skipped"]]
        counts = {"files_listed": len(self.sources_out), "files_used": len(used),
                  "files_skipped": sum(skipped.values()), "skipped_by_reason": skipped,
                  "text_bytes": sum(e["size"] for e in used),
                  # text that went into the shards only: a skipped file's bytes are in sources[], not here
                  "replaced_bytes": sum(e["replaced_bytes"] for e in used),
                  "files_with_replaced_bytes": sum(1 for e in used if e["replaced_bytes"])}
        tok = self.tok
        return {
            "format": FORMAT, "format_version": FORMAT_VERSION, "data_prep_version": __version__,
            "seq_len": self.options.seq_len, "row_len": self.options.seq_len + 1,
            "dtype": np.dtype(tok.token_dtype).name, "member_format": "{row:010d}.npy",
            "tokenizer": {"hash": tok.hash, "vocab_size": tok.vocab_size, "bos_id": tok.bos_id,
                          "eos_id": tok.eos_id, "pad_id": tok.pad_id, "encoder": self.plan.encoder,
                          "encoder_check": self.plan.encoder_check, "copy": TOKENIZER_SUBDIR},
            "parameters": self.options.recorded(), "splits": split_info, "counts": counts, "packing": packing,
            "rows": sum(s["rows"] for s in split_info.values()),
            "tokens": sum(s["tokens"] for s in split_info.values()),
            "sources": self.sources_out,
        }


def _our_outputs(out_dir: Path) -> list[Path]:
    """What a finished run leaves in an output directory: shards, manifest and tokenizer copy (nothing else)."""
    ours = [out_dir / MANIFEST_FILE, out_dir / TOKENIZER_SUBDIR]
    ours += [p for split in SPLITS for p in sorted(out_dir.glob(f"{split}-[0-9][0-9][0-9][0-9][0-9][0-9].tar"))]
    return [p for p in ours if p.exists()]


def staging_dir(out_dir: Path) -> Path:
    """Where a run writes its shards until they are complete (inside the output, so the final moves are renames)."""
    return Path(out_dir) / STAGING_SUBDIR


def prepare_output_dir(out_dir: Path, overwrite: bool) -> Path:
    """Check the output directory and make an empty staging directory in it; returns the staging directory.

    Earlier shards are refused unless overwrite. With overwrite they stay in place, untouched and readable, until the
    new set is complete (publish_outputs swaps them), so an interrupted or failed run loses nothing.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise DataPrepError(f"--output {out_dir} is a file, not a directory",
                            "pass a directory for --output (it is created when missing)")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise DataPrepError(f"cannot create --output {out_dir} ({err.strerror})",
                            "choose a writable location for --output") from err
    existing = _our_outputs(out_dir)
    if existing and not overwrite:
        raise DataPrepError(f"{out_dir} already holds shards or a manifest ({existing[0].name})",
                            "choose another --output or pass --overwrite")
    staging = staging_dir(out_dir)
    if staging.exists():          # left behind by a run that was killed
        shutil.rmtree(staging)
    staging.mkdir()
    return staging


def publish_outputs(staging: Path, out_dir: Path) -> None:
    """Swap a complete staged set (shards, tokenizer copy, manifest) for whatever the output held before.

    The old manifest goes first and the new one is moved in last, so at every moment the directory either is a
    complete dataset or has no manifest (which every reader reports as incomplete); this window lasts only for a
    few renames, while the long encoding and writing happen entirely in the staging directory.
    """
    old_manifest = out_dir / MANIFEST_FILE
    if old_manifest.exists():
        old_manifest.unlink()
    for path in _our_outputs(out_dir):
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    for path in sorted(staging.iterdir()):
        if path.name != MANIFEST_FILE:
            os.replace(path, out_dir / path.name)
    os.replace(staging / MANIFEST_FILE, old_manifest)
    staging.rmdir()


def progress_bar(total_bytes: int, enabled: bool):
    """A tqdm bar counting bytes of text."""
    from tqdm import tqdm
    return tqdm(total=total_bytes, unit="B", unit_scale=True, desc="encoding", disable=not enabled)


def prepare_shards(input_dir, tokenizer_dir, output_dir, options: ShardOptions) -> dict:
    """Tokenize, pack and shard a directory of text on this machine; returns the manifest (also written)."""
    options.validate()
    tok = load_tokenizer(tokenizer_dir, encoder=options.encoder)
    plan = plan_corpus(input_dir, tok, options)
    out_dir = Path(output_dir)
    staging = prepare_output_dir(out_dir, options.overwrite)
    assembler = ShardAssembler(plan, tok, options, staging)
    bar = progress_bar(sum(plan.sources[i].size for i in plan.tasks()), options.progress)
    documents = iter_encoded(plan, plan.tasks(), tokenizer_dir, options.workers, options.max_invalid_fraction, tok)
    return assemble_and_write(assembler, documents, bar, out_dir)


def assemble_and_write(assembler: ShardAssembler, documents, bar, out_dir: Path) -> dict:
    """Feed documents (in file order) to the assembler, which writes into its staging directory; then add the
    tokenizer copy and the manifest there and publish the whole set into out_dir.

    On any error (or an interrupt) the staging directory is removed and out_dir is left exactly as it was: no
    half-made dataset, and shards that --overwrite was going to replace are still there and readable.
    """
    staging = assembler.out_dir
    try:
        for doc in documents:
            assembler.add(doc)
            bar.update(doc.size)
        bar.close()
        manifest = assembler.finish()
        copy_tokenizer_files(assembler.tok, staging / TOKENIZER_SUBDIR)
        write_manifest(staging, manifest)
    except BaseException:
        bar.close()
        if hasattr(documents, "close"):
            documents.close()
        shutil.rmtree(staging, ignore_errors=True)
        raise
    publish_outputs(staging, Path(out_dir))
    return manifest
