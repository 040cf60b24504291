"""`data_prep shards` over work units: parquet, JSON lines and text inputs, spread over local workers, MPI ranks, the
tasks of a Slurm array or separate invocations, resumable after a kill, byte-identical however the work is split.

1. Plan: the inputs (sorted by name) are read as pieces (a text or JSON-lines file, a parquet row group) and grouped
   into units of about --unit-mb (data_prep.units); a unit's key ties it to the options, the tokenizer and its files'
   identity. Every invocation computes the same plan from the same command.
2. Units: task i of n takes the units whose index is i mod n (MPI: rank r of size s takes r mod s); within a task
   its local workers share them. A unit's shards are a pure function of the unit (data_prep.unit_work: its documents
   packed BOS d EOS ... into rows, its validation documents chosen among its own), written under OUT/.prep/tmp and
   committed by one rename (data_prep.unit_store). A unit already committed with its key is skipped, so a killed
   prep re-run with the same command does only what is missing.
3. Finalize (data_prep.finalize, automatic once every unit is committed): the units' shards are linked into the
   output in unit order under global names, their rows numbered on, and manifest.json is written last.

Cost of packing within units: under --packing stream each unit drops its split's last incomplete row (under
seq_len + 1 tokens per split and unit), so a 256 MB unit (~60M tokens) loses at most 2 x 2048 tokens at seq 2048:
under 0.01%. Under --packing bestfit (data_prep.packing) each unit's splits are best-fit packed from their own
buffer, drained at the unit's end, whose last row is padded (under seq_len + 1 pad tokens per split and unit).
"""
from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass, field
from pathlib import Path

from .errors import DataPrepError
from .filters import FieldFilter
from .inputs import InputFile, resolve_inputs
from .manifest import MANIFEST_FILE
from .packing import DEFAULT_PACK_BUFFER, check_packing
from .readers import ReadOptions, open_reader
from .stores import is_remote
from .tokenizer import load_tokenizer
from .unit_store import clear_task_tmp, commit_unit, committed, prep_dir, write_plan
from .unit_work import write_unit
from .units import DEFAULT_UNIT_BYTES, WorkUnit, options_fingerprint, plan_units


@dataclass
class UnitOptions:
    """What shapes the shards (recorded in the manifest and in every unit's key) and how this invocation runs."""

    seq_len: int
    shard_size: int = 8192
    val_fraction: float = 0.01
    glob: str = "*"
    format: str | None = None
    read: ReadOptions = field(default_factory=ReadOptions)
    min_chars: int = 0
    filters: tuple[FieldFilter, ...] = ()
    vocab_size: int | None = None  # pre-tokenized input: the ids' vocabulary (default: the tokenizer's)
    encoder: str = "auto"
    unit_bytes: int = DEFAULT_UNIT_BYTES
    packing: str = "stream"  # data_prep.packing; `data_prep shards` defaults to bestfit, this API keeps stream
    pack_buffer: int = DEFAULT_PACK_BUFFER
    # execution only: never change the output
    task_index: int = 0
    task_count: int = 1
    workers: int = 1
    finalize: bool = True
    overwrite: bool = False
    progress: bool = True

    @property
    def task(self) -> str:
        return f"{self.task_index}-of-{self.task_count}"

    def recorded(self) -> dict:
        r = self.read
        return {"seq_len": self.seq_len, "shard_size": self.shard_size, "val_fraction": self.val_fraction,
                "glob": self.glob, "text_field": r.text_field, "tokens_field": r.tokens_field, "id_field": r.id_field,
                "on_bad_record": r.on_bad_record, "max_invalid_fraction": r.max_invalid_fraction,
                "min_chars": self.min_chars, "filters": [f.text for f in self.filters],
                "vocab_size": self.vocab_size, "unit_bytes": self.unit_bytes, "packing": self.packing,
                "pack_buffer": self.pack_buffer}

    def validate(self) -> None:
        checks = [(self.seq_len >= 1, "--seq-len must be at least 1", "pass a positive --seq-len"),
                  (self.shard_size >= 1, "--shard-size must be at least 1 row", "pass a positive --shard-size"),
                  (0.0 <= self.val_fraction < 1.0, "--val-fraction must be in [0, 1)", "pass e.g. 0.01"),
                  (self.unit_bytes >= 1, "--unit-mb must be positive", "pass e.g. --unit-mb 256"),
                  (self.min_chars >= 0, "--min-chars must be >= 0", "pass 0 to keep every length"),
                  (self.workers >= 1, "--workers must be at least 1", "pass --workers 1 or more"),
                  (0 <= self.task_index < self.task_count, f"--task {self.task_index}/{self.task_count} is not a "
                   "task of the job", "pass --task I/N with 0 <= I < N")]
        for ok, problem, remedy in checks:
            if not ok:
                raise DataPrepError(problem, remedy)
        check_packing(self.packing, self.pack_buffer)


@dataclass
class UnitPlan:
    files: list[InputFile]
    units: list[WorkUnit]
    fingerprint: str
    tokenizer_hash: str


def plan_job(inputs: list[str], tok, options: UnitOptions) -> UnitPlan:
    """The same plan in every invocation of the same command (see the module docstring)."""
    options.validate()
    files = resolve_inputs(inputs, options.glob, options.format, options.read.s3_endpoint)
    if options.read.tokens_field and files[0].format != "parquet":
        raise DataPrepError(f"--tokens-field needs parquet input; the inputs are {files[0].format}",
                            "pass parquet files with a list-of-ints column, or drop --tokens-field")
    pieces = [(f, [f.size] if is_remote(f.location) else open_reader(f, options.read).pieces()) for f in files]
    fingerprint = options_fingerprint({**options.recorded(), "tokenizer": tok.hash})
    return UnitPlan(files, plan_units(pieces, options.unit_bytes, fingerprint), fingerprint, tok.hash)


_WORKER: dict = {}


def _init_worker(tokenizer_dir: str, encoder: str) -> None:
    _WORKER["tok"] = load_tokenizer(tokenizer_dir, encoder=encoder, verify=False)


def _run_unit(args) -> dict:
    unit, out, options = args
    tok = _WORKER["tok"]
    vocab = options.vocab_size or tok.vocab_size
    if options.read.tokens_field and vocab > tok.vocab_size:
        raise DataPrepError(f"--vocab-size {vocab} is larger than the tokenizer's {tok.vocab_size}",
                            "pass the tokenizer the ids were made with")
    holder: dict = {}

    def write(tmp: Path) -> dict:
        holder.update(write_unit(unit, tmp, options.read, tok.encode_to_array, (tok.bos_id, tok.eos_id, tok.pad_id),
                                 vocab, options.seq_len, options.shard_size, options.val_fraction, tok.token_dtype,
                                 options.min_chars, options.filters, options.packing, options.pack_buffer))
        return holder

    commit_unit(out, unit, write, options.task)
    return {"index": unit.index, "bytes": unit.size, "documents": holder["documents"],
            "tokens": sum(s["stream_tokens"] for s in holder["splits"].values())}


def run_units(plan: UnitPlan, tokenizer_dir, out: Path, options: UnitOptions, log=print, tok=None) -> dict:
    """Write this task's units that are not committed yet; returns {"done", "skipped", "seconds", "bytes", ...}.
    `tok`: the tokenizer already loaded here, used when the units run in this process."""
    out.mkdir(parents=True, exist_ok=True)
    if (out / MANIFEST_FILE).exists() and not options.overwrite:
        raise DataPrepError(f"{out} already holds a finished dataset ({MANIFEST_FILE})",
                            "choose another --output, or pass --overwrite to prepare it again")
    job = {"options": options.recorded(), "tokenizer": str(Path(tokenizer_dir).resolve()),
           "tokenizer_hash": plan.tokenizer_hash, "encoder": options.encoder}
    write_plan(out, plan.units, plan.fingerprint, job)
    clear_task_tmp(out, options.task)
    mine = [u for u in plan.units if u.index % options.task_count == options.task_index]
    done_before = committed(out, mine)
    todo = [u for u in mine if u.index not in done_before]
    log(f"units: {len(plan.units)} planned ({sum(u.size for u in plan.units) / 1e6:.1f} MB in {len(plan.files)} "
        f"files); task {options.task_index}/{options.task_count}: {len(mine)} units, {len(done_before)} already "
        f"committed (skipped), {len(todo)} to write")
    start = time.perf_counter()
    totals = {"done": 0, "skipped": len(done_before), "bytes": 0, "documents": 0, "tokens": 0}
    bar = _bar(sum(u.size for u in todo), options.progress)
    jobs = [(u, out, options) for u in todo]
    try:
        for result in _map(jobs, str(tokenizer_dir), options, tok):
            totals["done"] += 1
            for k in ("bytes", "documents", "tokens"):
                totals[k] += result[k]
            bar.update(result["bytes"])
            bar.set_postfix(docs=f"{totals['documents']:,}", tokens=f"{totals['tokens']:,}", refresh=False)
    finally:
        bar.close()
    totals["seconds"] = time.perf_counter() - start
    totals["workers"] = max(1, min(options.workers, len(todo)))  # the processes that actually ran units
    return totals


def _map(jobs, tokenizer_dir: str, options: UnitOptions, tok=None):
    if options.workers == 1 or len(jobs) <= 1:
        if tok is not None:
            _WORKER["tok"] = tok
        else:
            _init_worker(tokenizer_dir, options.encoder)
        yield from map(_run_unit, jobs)
        return
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(min(options.workers, len(jobs)), _init_worker, (tokenizer_dir, options.encoder)) as pool:
        yield from pool.imap(_run_unit, jobs)


def _bar(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="units", disable=not enabled)


def load_job_tokenizer(tokenizer_dir, options: UnitOptions):
    tok = load_tokenizer(tokenizer_dir, encoder=options.encoder)
    if options.vocab_size is not None and options.vocab_size > tok.vocab_size:
        raise DataPrepError(f"--vocab-size {options.vocab_size} is larger than the tokenizer's {tok.vocab_size}",
                            "pass the tokenizer the ids were made with")
    return tok


def all_committed(out: Path, plan: UnitPlan) -> bool:
    return len(committed(out, plan.units)) == len(plan.units)


def has_prep(out: Path) -> bool:
    return (prep_dir(out) / "plan.json").is_file()


