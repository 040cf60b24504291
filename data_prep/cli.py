"""Command line: `python -m data_prep {tokenizer,shards,synth,inspect,reindex,upload} ...` (see --help of each)."""
from __future__ import annotations

import argparse
import os
import sys
import time

from .errors import DataPrepError
from .paths import LocalPath

DEFAULT_LOCAL_WORKERS = min(os.cpu_count() or 1, 16)


def _add_tokenizer_parser(commands) -> None:
    p = commands.add_parser("tokenizer", help="train a byte-level BPE tokenizer on text, JSON lines or parquet",
                            description="Train a byte-level BPE (GPT-4-style split, 256-byte alphabet, specials "
                            "<|bos|> <|eos|> <|pad|>) and save it with its config and content hash. A text "
                            "directory is read from its first file on (--max-bytes); with --max-chars, or on "
                            "parquet / JSON lines / URLs, it trains on a deterministic sample drawn across every "
                            "input and reports bytes per token on held-out documents.")
    p.add_argument("--input", required=True, nargs="+",
                   help="directory of text files, or files, directories, globs or s3:// / http(s):// URLs of "
                   ".parquet / .jsonl[.gz|.zst] / text")
    p.add_argument("--output", required=True, type=LocalPath(), help="directory to write the tokenizer to")
    p.add_argument("--vocab-size", type=int, default=32768, help="vocabulary size incl. specials (default 32768)")
    p.add_argument("--glob", default="*", help="file-name pattern of the documents (default: every file)")
    p.add_argument("--max-bytes", type=int, default=None, help="train on at most this many bytes of text")
    p.add_argument("--min-frequency", type=int, default=0, help="minimum pair count for a merge (default 0)")
    s = p.add_argument_group("a sample across every input (parquet, JSON lines, URLs; text with --max-chars)")
    s.add_argument("--max-chars", type=float, default=None,
                   help="characters to train on, drawn across all inputs (the paper: 2e9; default 2e9 there)")
    s.add_argument("--held-out-chars", type=float, default=2e6,
                   help="characters of held-out documents for the bytes-per-token report (default 2e6)")
    s.add_argument("--format", choices=("text", "jsonl", "parquet"), default=None, help="refuse other formats")
    s.add_argument("--text-field", default="text", help="field/column holding the text (default text)")
    s.add_argument("--min-chars", type=int, default=0, help="skip documents shorter than this")
    s.add_argument("--filter", action="append", default=[], metavar="'FIELD>=VALUE'",
                   help="keep documents whose numeric field passes (repeatable)")
    s.add_argument("--on-bad-record", choices=("error", "skip"), default="error",
                   help="a JSON line that does not parse or a non-string text: stop (default) or skip")
    s.add_argument("--s3-endpoint", default=None, help="an S3-compatible store's URL (default: AWS_ENDPOINT_URL)")
    p.add_argument("--overwrite", action="store_true", help="replace a tokenizer already in --output")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _add_shards_parser(commands) -> None:
    p = commands.add_parser("shards", help="tokenize and pack text, JSON lines or parquet into webdataset shards",
                            description="Encode every document (a text file, a JSON line, a parquet row; BOS/EOS "
                            "around each), pack rows of seq_len+1 tokens, write tar shards (one .npy per row) and "
                            "manifest.json. JSON lines and parquet (optionally .gz/.zst; parquet read by row group) "
                            "are prepared in work units: spread over --workers, MPI ranks or --task I/N invocations, "
                            "resumable (a re-run skips committed units) and byte-identical however the work is split. "
                            "A text directory is packed as one stream unless --engine units. The output is identical "
                            "for any number of workers or ranks.")
    p.add_argument("--input", required=True, nargs="+",
                   help="text directory, or files, directories and globs of .parquet / .jsonl[.gz|.zst] / text, "
                   "or s3:// / http(s):// URLs of such files")
    p.add_argument("--tokenizer", required=True, type=LocalPath(),
                   help="tokenizer directory (from `data_prep tokenizer`)")
    p.add_argument("--output", required=True, type=LocalPath("--out"),
                   help="local directory to write shards and manifest.json to (--out URL uploads them)")
    p.add_argument("--seq-len", type=int, required=True, help="sequence length; rows hold seq_len + 1 tokens")
    p.add_argument("--workers", type=int, default=None,
                   help=f"encoding processes per rank (default {DEFAULT_LOCAL_WORKERS} locally, 1 under MPI)")
    p.add_argument("--val-fraction", type=float, default=0.01,
                   help="fraction of documents held out for validation, chosen by file-name hash (default 0.01)")
    p.add_argument("--shard-size", type=int, default=8192, help="rows per shard (default 8192)")
    p.add_argument("--keep-last-partial", action="store_true",
                   help="keep each split's final incomplete row, padded with <|pad|> (default: drop it; bestfit "
                   "always keeps it)")
    p.add_argument("--packing", choices=("bestfit", "stream"), default="bestfit",
                   help="bestfit (default, as the published runs): every row starts at a document's BOS, filled with "
                   "the longest buffered documents that fit, the shortest cut to fill it (its rest dropped); stream: "
                   "one stream of documents cut at fixed offsets, documents span rows (nothing dropped but the tail)")
    p.add_argument("--pack-buffer", type=int, default=1000,
                   help="bestfit: documents buffered to choose from (default 1000)")
    p.add_argument("--glob", default="*", help="file-name pattern of the documents (default: every file)")
    p.add_argument("--encoder", choices=("auto", "tiktoken", "hf"), default="auto",
                   help="auto: tiktoken when it matches HF ids on a sample, else HF")
    p.add_argument("--max-invalid-fraction", type=float, default=0.1,
                   help="skip (and count) files with more than this fraction of invalid UTF-8 bytes")
    p.add_argument("--mpi", choices=("auto", "on", "off"), default="auto",
                   help="auto: use MPI when started by mpirun/mpiexec")
    _add_unit_arguments(p)
    p.add_argument("--overwrite", action="store_true", help="replace shards already in --output")
    p.add_argument("--out", default=None, metavar="URL",
                   help="then upload --output to s3://bucket/prefix (or a directory), the manifest last")
    p.add_argument("--s3-endpoint", default=None, help="an S3-compatible store's URL (default: AWS_ENDPOINT_URL)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _add_unit_arguments(p) -> None:
    g = p.add_argument_group("work units (parquet, JSON lines; text with --engine units)")
    g.add_argument("--engine", choices=("auto", "units", "stream"), default="auto",
                   help="auto: work units for parquet/JSON lines, one stream for a text directory")
    g.add_argument("--format", choices=("text", "jsonl", "parquet"), default=None,
                   help="refuse inputs of any other format (default: the one the inputs share)")
    g.add_argument("--text-field", default="text", help="field/column holding the text (default text)")
    g.add_argument("--tokens-field", default=None,
                   help="parquet column of token ids (list of ints): skips the tokenizer's encoding")
    g.add_argument("--id-field", default=None,
                   help="field naming each document (its validation split hashes it; default: file and row)")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="pre-tokenized ids must be below this (default: the tokenizer's vocabulary size)")
    g.add_argument("--min-chars", type=int, default=0, help="skip (and count) documents shorter than this")
    g.add_argument("--filter", action="append", default=[], metavar="'FIELD>=VALUE'",
                   help="keep documents whose numeric field passes, e.g. 'int_score>=3' (repeatable)")
    g.add_argument("--on-bad-record", choices=("error", "skip"), default="error",
                   help="a JSON line that does not parse or a non-string text: stop (default) or skip and count")
    g.add_argument("--unit-mb", type=float, default=256.0, help="input megabytes per work unit (default 256)")
    g.add_argument("--task", default="0/1", metavar="I/N",
                   help="do units I, I+N, I+2N, ... (0-based; a Slurm array: "
                   "$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT); with N > 1 run `data_prep finalize "
                   "--output OUT` once every task has finished")


def _add_synth_parser(commands) -> None:
    p = commands.add_parser(
        "synth", help="write a synthetic reasoning dataset (k-hop pointers, k-step arithmetic) as shards",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write rows of a task whose answers need k sequential steps as ordinary shards (what `shards` "
        "writes: train with data.shards=OUT and model.vocab_size=the vocabulary printed), with the task's "
        "word-level tokenizer in OUT/tokenizer and the place and hops of every answer in OUT/synth-{train,val}.npy "
        "(`megaloop eval RUN --tasks synth` reports accuracy by hops from them). Tasks: khop (a random cycle through "
        "8 letters written as pairs 'c > h', then queries 'x k = y': y is k pointer steps from x; khop10, khop16: "
        "through 10 or 16 letters) and modarith ('x +a *m -b ... = y', k operations modulo 7). Rows are seeded by "
        "(seed, row), val rows from their own key stream, val tables unseen in train; the same options give the "
        "same bytes.",
        epilog="example:\n  python -m data_prep synth --task khop --out data/khop --hops 1..2 --rows 16384\n"
        "  python -m megaloop train configs/parcae-synth.yaml --set data.shards=data/khop --set train.out_dir=runs/khop\n"
        "  python -m megaloop eval runs/khop --tasks synth --depths 1,2,4,8,16")
    p.add_argument("--task", required=True, help="khop, khop10, khop16 or modarith")
    p.add_argument("--out", required=True, type=LocalPath(), help="directory to write the dataset to")
    p.add_argument("--hops", default=None, metavar="A..B",
                   help="difficulties, drawn uniformly per query (default 1..4; at most: khop 7, khop10 9, khop16 "
                   "15, modarith 16)")
    p.add_argument("--rows", type=int, default=8192,
                   help="train rows (default 8192; khop's 5040 distinct tables allow at most about 20000, so that "
                   "val tables can be unseen)")
    p.add_argument("--val-rows", type=int, default=512, help="held-out rows (default 512)")
    p.add_argument("--seed", type=int, default=0, help="seed of every row's generator (default 0)")
    p.add_argument("--seq-len", type=int, default=128, help="sequence length; rows hold seq_len + 1 tokens")
    p.add_argument("--shard-size", type=int, default=8192, help="rows per shard (default 8192)")
    p.add_argument("--overwrite", action="store_true", help="replace a dataset already in --out")


def _add_finalize_parser(commands) -> None:
    p = commands.add_parser("finalize", help="write the dataset once every work unit of a prep is committed",
                            description="Link the committed work units' shards into OUTPUT under global names and "
                            "write manifest.json last; needed after `shards --task I/N` runs with N > 1.")
    p.add_argument("--output", required=True, type=LocalPath(), help="the --output of the shards runs")


def _add_upload_parser(commands) -> None:
    p = commands.add_parser("upload", help="upload a shard directory to s3://bucket/prefix, the manifest last",
                            description="Upload every file of a complete shard directory, manifest.json last (a "
                            "manifest already at URL is deleted first), so that readers never see a half-written "
                            "dataset; an interrupted upload leaves no manifest. Credentials and region come from "
                            "the standard AWS environment variables and config files.")
    p.add_argument("local_dir", type=LocalPath("the URL argument after it"),
                   help="directory written by `data_prep shards`")
    p.add_argument("url", help="s3://bucket/prefix (or a local directory)")
    p.add_argument("--s3-endpoint", default=None, help="an S3-compatible store's URL (default: AWS_ENDPOINT_URL)")
    p.add_argument("--retries", type=int, default=6, help="attempts per file on transient errors (default 6)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _add_inspect_parser(commands) -> None:
    p = commands.add_parser("inspect", help="report on a shard directory and check its checksums",
                            description="Print counts, verify shard checksums and structure, check the tokenizer "
                            "hash and decode a sample row. Exit status 1 when anything is wrong.")
    p.add_argument("shard_dir", help="directory written by `data_prep shards`, or the s3:// or http(s):// URL it was "
                   "uploaded to (read as the loader reads it)")
    p.add_argument("--s3-endpoint", default=None, help="an S3-compatible store's URL (default: AWS_ENDPOINT_URL)")
    p.add_argument("--verify", choices=("full", "fast", "none"), default="full",
                   help="full: sha256 of every shard; fast: sizes only; none")
    p.add_argument("--tokenizer", default=None, type=LocalPath(),
                   help="tokenizer directory (default: SHARD_DIR/tokenizer)")
    p.add_argument("--split", default="train", help="split to take the sample row from")
    p.add_argument("--sample-tokens", type=int, default=96, help="tokens of the sample row to decode")
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def _add_reindex_parser(commands) -> None:
    p = commands.add_parser("reindex", help="record member offsets in the manifest of shards made before they were",
                            description="Scan each shard's tar headers once, check them against the manifest and "
                            "rewrite manifest.json (atomically) with each shard's data offset and stride, so that "
                            "readers never scan a shard. The shards are not changed; saved loader states stay valid.")
    p.add_argument("--shards", required=True, type=LocalPath(),
                   help="directory written by `data_prep shards`")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m data_prep", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    _add_tokenizer_parser(commands)
    _add_shards_parser(commands)
    _add_synth_parser(commands)
    _add_finalize_parser(commands)
    _add_inspect_parser(commands)
    _add_reindex_parser(commands)
    _add_upload_parser(commands)
    return parser


def _samples_inputs(args) -> bool:
    """A sample across the inputs, unless one local directory of text files with none of the sample options."""
    from pathlib import Path

    from .inputs import detect_format, walk

    if len(args.input) > 1 or not Path(args.input[0]).is_dir() or args.max_chars is not None:
        return True
    if args.format or args.text_field != "text" or args.min_chars or args.filter or args.on_bad_record != "error":
        return True
    return any(detect_format(p.name)[0] != "text" for p in walk(Path(args.input[0]), args.glob))


def _train_on_sample(args):
    from .filters import parse_filter
    from .readers import ReadOptions
    from .tokenizer import check_training_options, train_on_texts
    from .tokenizer_sample import bytes_per_token, sample_documents

    if args.max_bytes is not None:
        raise DataPrepError("--max-bytes reads a text directory from its first file; a sample takes --max-chars",
                            "pass --max-chars instead")
    max_chars = int(args.max_chars if args.max_chars is not None else 2e9)
    if max_chars < 1 or args.held_out_chars < 0:
        raise DataPrepError(f"--max-chars {args.max_chars} / --held-out-chars {args.held_out_chars}",
                            "pass a positive --max-chars and a --held-out-chars >= 0")
    check_training_options(args.vocab_size, args.min_frequency, args.output, args.overwrite)
    filters = tuple(parse_filter(f) for f in args.filter)
    read = ReadOptions(text_field=args.text_field, meta_fields=tuple(dict.fromkeys(f.field for f in filters)),
                       on_bad_record=args.on_bad_record, s3_endpoint=args.s3_endpoint)
    sample = sample_documents(args.input, read, max_chars, int(args.held_out_chars), args.glob, args.format,
                              args.min_chars, filters, progress=not args.quiet)
    tok = train_on_texts(sample.texts, sample.summary, args.output, args.vocab_size, args.min_frequency,
                         progress=not args.quiet)
    return tok, sample, bytes_per_token(tok, sample.held_out)


def run_tokenizer(args) -> int:
    from .tokenizer import SAMPLE_FILE, train_tokenizer

    start = time.perf_counter()
    if _samples_inputs(args):
        tok, sample, held_bpt = _train_on_sample(args)
        s = sample.summary
        print(f"trained in {time.perf_counter() - start:.1f} s on {s['documents']} documents "
              f"({s['text_chars'] / 1e6:.1f}M characters from {s['pieces_read']} pieces of {s['files']} files), "
              f"vocab {tok.vocab_size}, skipped {s['skipped']}")
        print(f"hash {tok.hash}\nencoder {tok.encoder_name}")
        print(f"bytes per token on {s['held_out_documents']} held-out documents ({s['held_out_chars'] / 1e6:.2f}M "
              f"characters): {held_bpt:.3f}")
        return 0
    if len(args.input) > 1:
        raise DataPrepError("several --input need a sample", "pass --max-chars")
    args.input = args.input[0]
    tok = train_tokenizer(args.input, args.output, args.vocab_size, args.glob, args.max_bytes, args.min_frequency,
                          args.overwrite, progress=not args.quiet)
    seconds = time.perf_counter() - start
    corpus = tok.config["training_corpus"]
    print(f"trained in {seconds:.1f} s on {corpus['files']} files ({corpus['text_bytes'] / 1e6:.1f} MB), "
          f"vocab {tok.vocab_size}, skipped {corpus['skipped']}, {corpus['replaced_bytes']} bytes replaced")
    if tok.vocab_size < args.vocab_size:
        print(f"note: the corpus only supported {tok.vocab_size} of the {args.vocab_size} tokens asked for")
    print(f"hash {tok.hash}\nencoder {tok.encoder_name}" + (f" ({tok.fast_problem})" if tok.fast_problem else ""))
    sample = (tok.directory / SAMPLE_FILE).read_text(encoding="utf-8")
    if sample:
        print(f"bytes per token on the verification sample: {len(sample.encode()) / len(tok.encode(sample)):.3f}")
    return 0


def run_shards(args) -> int:
    from .mpi_prepare import launched_by_mpi, prepare_shards_mpi, world_communicator
    from .prepare import ShardOptions, prepare_shards

    use_mpi = args.mpi == "on" or (args.mpi == "auto" and launched_by_mpi())
    comm = world_communicator() if use_mpi else None
    rank = comm.Get_rank() if comm is not None else 0
    workers = args.workers if args.workers is not None else (1 if use_mpi else DEFAULT_LOCAL_WORKERS)
    if _uses_units(args):
        from .unit_cli import run_unit_shards

        return run_unit_shards(args, comm, workers)
    if len(args.input) > 1:
        raise DataPrepError(f"--input {' '.join(args.input)}: a text prep in one stream takes one directory",
                            "pass one directory, or --engine units for several inputs")
    args.input = args.input[0]
    options = ShardOptions(seq_len=args.seq_len, shard_size=args.shard_size, val_fraction=args.val_fraction,
                           keep_last_partial=args.keep_last_partial, glob=args.glob, encoder=args.encoder,
                           max_invalid_fraction=args.max_invalid_fraction, packing=args.packing,
                           pack_buffer=args.pack_buffer, workers=workers, overwrite=args.overwrite,
                           progress=not args.quiet and rank == 0)
    start = time.perf_counter()
    try:
        if comm is None:
            manifest = prepare_shards(args.input, args.tokenizer, args.output, options)
        else:
            manifest = prepare_shards_mpi(args.input, args.tokenizer, args.output, options, comm)
    except BaseException as err:
        if getattr(err, "collective", False) and rank != 0:
            return 2                     # rank 0 reports the error that every rank has seen
        if comm is not None and comm.Get_size() > 1 and not getattr(err, "collective", False):
            print(f"error on MPI rank {rank}: {err}", file=sys.stderr, flush=True)
            comm.Abort(2)
        raise
    if manifest is not None:
        _print_shard_summary(manifest, time.perf_counter() - start, comm.Get_size() if comm else 1, workers)
    if args.out is not None:
        from .upload import upload_after_prepare

        try:
            done = upload_after_prepare(args.output, args.out, comm, args.s3_endpoint, progress=not args.quiet)
        except DataPrepError as err:
            if rank != 0:
                return 2  # rank 0 reports it
            raise err from None
        if done is not None:
            print(f"uploaded {done['files']} files ({done['bytes'] / 1e6:.1f} MB) to {args.out}, manifest last")
    return 0


UNIT_ONLY = {"format": None, "tokens_field": None, "id_field": None, "vocab_size": None, "min_chars": 0,
             "filter": [], "on_bad_record": "error", "unit_mb": 256.0, "task": "0/1", "text_field": "text"}


def _uses_units(args) -> bool:
    """Work units unless --engine stream, or (auto) one directory of text files with no unit-only option."""
    if args.engine != "auto":
        return args.engine == "units"
    from pathlib import Path

    from .inputs import detect_format, walk

    if len(args.input) > 1 or not Path(args.input[0]).is_dir():
        return True
    if any(getattr(args, name) != default for name, default in UNIT_ONLY.items()):
        return True
    return any(detect_format(p.name)[0] != "text" for p in walk(Path(args.input[0]), args.glob))


def run_synth(args) -> int:
    from .synth import SynthOptions, parse_hops, task_named, write_synth

    start = time.perf_counter()
    options = SynthOptions(args.task, parse_hops(args.hops, task_named(args.task)), args.rows, args.val_rows,
                           args.seed, args.seq_len, args.shard_size, args.overwrite)
    manifest = write_synth(args.out, options)
    for split, entry in manifest["synth"]["queries"].items():
        info = manifest["splits"][split]
        print(f"{split}: {info['rows']} rows, {entry['queries']} queries ({entry['queries'] / info['rows']:.1f} a row, "
              f"{entry['queries'] / info['tokens']:.1%} of the tokens are answers)")
    print(f"task {options.task}, hops {options.hops[0]}..{options.hops[1]}, vocabulary "
          f"{manifest['tokenizer']['vocab_size']} (model.vocab_size), seq_len {options.seq_len}, written to "
          f"{args.out} in {time.perf_counter() - start:.1f} s")
    return 0


def run_finalize(args) -> int:
    from .finalize import finalize
    from .unit_cli import print_unit_summary

    start = time.perf_counter()
    manifest = finalize(args.output)
    print_unit_summary(manifest, time.perf_counter() - start, None)
    return 0


def _print_shard_summary(manifest: dict, seconds: float, ranks: int, workers: int) -> None:
    from .packing import split_summary, summary_lines

    counts = manifest["counts"]
    for split, info in sorted(manifest["splits"].items()):
        print(f"{split}: {info['rows']} rows ({info['tokens']} tokens) in {len(info['shards'])} shards, "
              f"{info['documents']} documents, {split_summary(manifest, split)}")
    print("\n".join(summary_lines(manifest)))
    print(f"files: {counts['files_used']} used, {counts['files_skipped']} skipped {counts['skipped_by_reason']}, "
          f"{counts['replaced_bytes']} invalid bytes replaced in {counts['files_with_replaced_bytes']} files")
    mb = counts["text_bytes"] / 1e6
    print(f"{mb:.1f} MB of text in {seconds:.1f} s = {mb / seconds:.2f} MB/s "
          f"({ranks} rank(s) x {workers} worker(s), encoder {manifest['tokenizer']['encoder']})")


def run_inspect(args) -> int:
    from pathlib import Path

    from .inspect_cmd import inspect_shards
    from .manifest import read_manifest

    if args.sample_tokens < 0:
        raise DataPrepError(f"--sample-tokens must be >= 0, got {args.sample_tokens}", "pass e.g. --sample-tokens 96")
    if args.tokenizer is not None and not Path(args.tokenizer).is_dir():
        raise DataPrepError(f"--tokenizer {args.tokenizer} is not a directory",
                            "pass the directory written by `python -m data_prep tokenizer`, or leave --tokenizer out "
                            "to use the copy in SHARD_DIR/tokenizer")
    from .paths import is_url
    from .sources import open_source

    if is_url(args.shard_dir):
        source = open_source(args.shard_dir, s3_endpoint=args.s3_endpoint)
        try:
            splits = sorted(source.manifest()["splits"])
        finally:
            source.close()
    else:
        splits = sorted(read_manifest(args.shard_dir)["splits"])
    if args.split not in splits:
        raise DataPrepError(f"--split {args.split!r} is not a split of {args.shard_dir}", f"use one of {splits}")
    problems = inspect_shards(args.shard_dir, args.verify, args.tokenizer, args.split, args.sample_tokens,
                              progress=not args.quiet, s3_endpoint=args.s3_endpoint)
    print("OK" if problems == 0 else f"{problems} problem(s) found")
    return 0 if problems == 0 else 1


def run_upload(args) -> int:
    from .stores import RetryPolicy
    from .upload import upload

    if args.retries < 1:
        raise DataPrepError(f"--retries must be >= 1, got {args.retries}", "pass e.g. --retries 6")
    start = time.perf_counter()
    done = upload(args.local_dir, args.url, args.s3_endpoint, RetryPolicy(attempts=args.retries),
                  progress=not args.quiet)
    print(f"uploaded {done['files']} files ({done['bytes'] / 1e6:.1f} MB) to {args.url} in "
          f"{time.perf_counter() - start:.1f} s, manifest last")
    return 0


def run_reindex(args) -> int:
    from .reindex import reindex

    start = time.perf_counter()
    done = reindex(args.shards)
    print(f"{args.shards}: member offsets of {done['shards']} shards recorded in {time.perf_counter() - start:.1f} s"
          if done["changed"] else f"{args.shards}: the manifest already records the member offsets; nothing to do")
    return 0


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    handler = {"tokenizer": run_tokenizer, "shards": run_shards, "synth": run_synth, "finalize": run_finalize,
               "inspect": run_inspect, "reindex": run_reindex, "upload": run_upload}[args.command]
    try:
        return handler(args)
    except DataPrepError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader of stdout went away (e.g. `inspect ... | head`): stop quietly, as `cat` does
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except KeyboardInterrupt:
        print("error: interrupted (an output directory keeps what it held before)", file=sys.stderr)
        return 130
    except OSError as err:
        where = f" {err.filename}" if err.filename else ""
        print(f"error: cannot access{where}: {err.strerror or err}. What to do: check that the path exists, is of "
              "the right kind (file or directory) and is readable/writable, then re-run", file=sys.stderr)
        return 2
