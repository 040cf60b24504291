"""`data_prep shards` over work units (data_prep.unit_prepare): options from the command line, the MPI split, the
automatic finalize and the report."""
from __future__ import annotations

import sys
import time
from pathlib import Path

from .errors import DataPrepError
from .filters import parse_filter
from .readers import ReadOptions


def parse_task(spec: str) -> tuple[int, int]:
    try:
        index, count = (int(x) for x in spec.split("/"))
    except ValueError:
        raise DataPrepError(f"--task {spec!r} is not I/N", "pass e.g. --task 0/4 (task 0 of 4)") from None
    if count < 1 or not 0 <= index < count:
        raise DataPrepError(f"--task {spec}: needs 0 <= I < N", "tasks are numbered 0 to N-1")
    return index, count


def unit_options(args, workers: int, comm):
    from .unit_prepare import UnitOptions

    index, count = parse_task(args.task)
    if comm is not None and comm.Get_size() > 1:
        if count > 1:
            raise DataPrepError("--task I/N and an MPI job of several ranks both split the units",
                                "use one: the MPI ranks, or separate --task invocations")
        index, count = comm.Get_rank(), comm.Get_size()
    read = ReadOptions(text_field=args.text_field, tokens_field=args.tokens_field, id_field=args.id_field,
                       meta_fields=tuple(dict.fromkeys(f.field for f in map(parse_filter, args.filter))),
                       on_bad_record=args.on_bad_record, max_invalid_fraction=args.max_invalid_fraction,
                       s3_endpoint=args.s3_endpoint)
    return UnitOptions(seq_len=args.seq_len, shard_size=args.shard_size, val_fraction=args.val_fraction,
                       glob=args.glob, format=args.format, read=read, min_chars=args.min_chars,
                       filters=tuple(parse_filter(f) for f in args.filter), vocab_size=args.vocab_size,
                       encoder=args.encoder, unit_bytes=int(args.unit_mb * 1e6), packing=args.packing,
                       pack_buffer=args.pack_buffer, task_index=index, task_count=count,
                       workers=workers, overwrite=args.overwrite, progress=not args.quiet and index == 0)


def run_unit_shards(args, comm, workers: int) -> int:
    from .finalize import finalize
    from .unit_prepare import all_committed, load_job_tokenizer, plan_job, run_units

    options = unit_options(args, workers, comm)
    if args.keep_last_partial:
        raise DataPrepError("--keep-last-partial is not available over work units (each unit drops its last "
                            "incomplete row)", "leave it out")
    out = Path(args.output)
    rank0 = comm is None or comm.Get_rank() == 0
    log = print if rank0 or options.task_count == 1 else (lambda *a: None)
    start = time.perf_counter()
    error = None
    try:
        tok = load_job_tokenizer(args.tokenizer, options)
        plan = plan_job(args.input, tok, options)
        totals = run_units(plan, args.tokenizer, out, options, log=print if options.task_index == 0 else log, tok=tok)
    except BaseException as err:  # under MPI every rank learns of a failure before anyone finalizes
        error = err
    if comm is not None and comm.Get_size() > 1:
        failed = comm.allgather(None if error is None else f"rank {comm.Get_rank()}: {error}")
        problems = [f for f in failed if f]
        if problems:
            if error is not None and rank0:
                raise error
            if rank0:
                raise DataPrepError(problems[0], "fix the input, then run the same command again: committed "
                                    "units are kept")
            return 2
    elif error is not None:
        raise error
    per = totals["bytes"] / 1e6 / max(totals["seconds"], 1e-9) / totals["workers"]
    print(f"task {options.task_index}/{options.task_count}: wrote {totals['done']} units ({totals['bytes'] / 1e6:.1f}"
          f" MB, {totals['documents']:,} documents, {totals['tokens']:,} tokens) in {totals['seconds']:.1f} s = "
          f"{per:.2f} MB/s per worker x {totals['workers']}; {totals['skipped']} committed before, skipped",
          file=sys.stdout if rank0 else sys.stderr)
    if not rank0:
        return 0
    if options.task_count > 1 and comm is None:
        print(f"when every task has finished: python -m data_prep finalize --output {out}")
        return 0
    if not all_committed(out, plan):
        raise DataPrepError(f"{out}: some work units are still missing", "run the same command again")
    manifest = finalize(out)
    print_unit_summary(manifest, time.perf_counter() - start, options)
    if args.out is not None:
        from .upload import upload_after_prepare

        done = upload_after_prepare(args.output, args.out, None, args.s3_endpoint, progress=not args.quiet)
        if done is not None:
            print(f"uploaded {done['files']} files ({done['bytes'] / 1e6:.1f} MB) to {args.out}, manifest last")
    return 0


def print_unit_summary(manifest: dict, seconds: float, options) -> None:
    from .packing import split_summary, summary_lines

    counts = manifest["counts"]
    for split, info in sorted(manifest["splits"].items()):
        print(f"{split}: {info['rows']} rows ({info['tokens']} tokens) in {len(info['shards'])} shards, "
              f"{info['documents']} documents, {split_summary(manifest, split)} (packed within work units)")
    print("\n".join(summary_lines(manifest)))
    print(f"documents: {counts['documents_used']} kept, {counts['documents_skipped']} skipped "
          f"{counts['skipped_by_reason']}; {counts['files_listed']} input files in {counts['units']} work units")
    asked = manifest["parameters"]["val_fraction"]
    got = manifest["splits"]["val"]["documents"] / max(counts["documents_used"], 1)
    if asked > 0 and got > 2 * asked:
        print(f"note: validation holds {got:.1%} of the documents, --val-fraction {asked}: each work unit holds at "
              f"least one, and these units hold few documents; raise --unit-mb for the asked fraction")
    mb = counts["text_bytes"] / 1e6
    workers = f" ({options.task_count} task(s) x {options.workers} worker(s))" if options is not None else ""
    print(f"{mb:.1f} MB of input in {seconds:.1f} s = {mb / max(seconds, 1e-9):.2f} MB/s{workers}, "
          f"encoder {manifest['tokenizer']['encoder']}")
