"""`python -m slurm prep --tasks N ... -- SHARDS_ARGS`: `data_prep shards` as one Slurm job array of N tasks (task
i prepares the work units i, i+N, ...; `--task $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT`, its workers one per
CPU of the task) and a finalize job that runs once every task has succeeded (`--dependency=afterok:ARRAY`), which
links the units into the dataset and writes the manifest last.

A task that fails (a node lost, a time limit) leaves its committed units: submitting the same command again redoes
only the missing ones, and the new finalize job waits for the new array. The shards arguments are checked here with
data_prep's own parser before anything is queued."""
from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path

from slurm import options
from slurm.script import output_pattern, sbatch_quote
from slurm.spec import default_python

sh = shlex.quote
DEFAULT_NAME = "data-prep"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("prep", help="data_prep shards as a job array plus a finalize job",
                       description=__doc__.split("\n\n")[0].replace("\n", " "),
                       epilog="example: python -m slurm prep --tasks 64 --cpus-per-task 64 --partition cpu --time "
                              "04:00:00 -- --input '/lustre/fineweb-edu/sample/100BT/*.parquet' --tokenizer TOK "
                              "--output /lustre/data/fineweb-edu-2048 --seq-len 2048 --id-field id")
    p.add_argument("--tasks", type=int, required=True, help="array tasks (each takes every N-th work unit)")
    p.add_argument("--cpus-per-task", type=int, required=True, help="CPUs per task: its encoding workers")
    p.add_argument("--partition", required=True, help="Slurm partition (comma list allowed)")
    p.add_argument("--time", required=True, help="time limit per task, e.g. 04:00:00")
    p.add_argument("--account", help="Slurm account to charge")
    p.add_argument("--array-parallel", type=int, help="run at most this many tasks at once (--array=0-K%%P)")
    p.add_argument("--job-name", default=DEFAULT_NAME, help=f"job name (default {DEFAULT_NAME})")
    p.add_argument("--python", help="interpreter on the nodes (default: the one running this command)")
    p.add_argument("--dry-run", action="store_true", help="print both sbatch scripts instead of submitting them")
    p.add_argument("shards_args", nargs=argparse.REMAINDER, help="after --: the arguments of `data_prep shards`")
    return p


def build(args, argv: list[str]) -> dict:
    """The job's validated facts (one-line OptionError for a bad value)."""
    from data_prep.cli import build_parser

    shards = list(args.shards_args[1:] if args.shards_args[:1] == ["--"] else args.shards_args)
    if not shards:
        raise options.OptionError("--", "", "give the `data_prep shards` arguments after --")
    parsed = _parse_shards(build_parser(), shards)
    if parsed.task != "0/1":
        raise options.OptionError("--task", parsed.task, "is set by the array for each task; leave it out")
    if parsed.workers is not None:
        raise options.OptionError("--workers", parsed.workers, "is the task's CPUs (--cpus-per-task); leave it out")
    options.time_seconds(args.time)
    name = options.job_name(args.job_name)
    out = str(Path(parsed.output).resolve())
    return {"tasks": options.positive("--tasks", args.tasks), "cpus": options.positive("--cpus-per-task",
            args.cpus_per_task), "time": args.time.strip(), "name": name, "out": out,
            "partition": options.slurm_name("--partition", args.partition, allow_list=True),
            "account": options.slurm_name("--account", args.account),
            "parallel": options.positive("--array-parallel", args.array_parallel) if args.array_parallel else None,
            "python": options.text("--python", args.python) if args.python else default_python(None),
            "shards": shards, "log_dir": str(Path(out).parent / f"{Path(out).name}.slurm"),
            "command_line": "python -m slurm " + shlex.join(argv)}


def _parse_shards(parser, shards: list[str]):
    """data_prep's own parse of the shards arguments; its usage error becomes one OptionError line."""
    import contextlib
    import io

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(["shards", *shards])
    except SystemExit:
        last = (err.getvalue().strip().splitlines() or ["invalid arguments"])[-1]
        raise options.OptionError("--", shlex.join(shards), f"data_prep shards refuses them: {last}") from None


def _header(job: dict, what: str, array: bool) -> list[str]:
    lines = ["#!/bin/bash", f"# megaloop data preparation: {what}, rendered by `python -m slurm`",
             f"#   {job['command_line']}"]
    opts = [("job-name", sbatch_quote(job["name"] + ("" if array else "-finalize")))]
    opts += [("partition", sbatch_quote(job["partition"]))] if job["partition"] else []
    opts += [("account", sbatch_quote(job["account"]))] if job["account"] else []
    if array:
        limit = f"%{job['parallel']}" if job["parallel"] else ""
        opts += [("array", f"0-{job['tasks'] - 1}{limit}")]
    opts += [("ntasks", "1"), ("cpus-per-task", str(job["cpus"] if array else 1)), ("time", job["time"]),
             ("output", sbatch_quote(output_pattern(job["log_dir"], "%A_%a.out" if array else "finalize-%j.out")))]
    return lines + [f"#SBATCH --{k}={v}" for k, v in opts]


def render(job: dict) -> tuple[str, str]:
    """(the array's script, the finalize job's script)."""
    shards = " ".join(sh(a) for a in job["shards"])
    array = _header(job, f"`data_prep shards` over {job['tasks']} array tasks", True) + [
        "", "set -euo pipefail",
        "# task I of N prepares work units I, I+N, ...; units committed before (an earlier, killed run) are skipped",
        f"exec {sh(job['python'])} -m data_prep shards {shards} --quiet \\",
        '    --task "$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT" --workers "$SLURM_CPUS_PER_TASK"']
    final = _header(job, "finalize once every array task succeeded", False) + [
        "", "set -euo pipefail", f"exec {sh(job['python'])} -m data_prep finalize --output {sh(job['out'])}"]
    return "\n".join(array) + "\n", "\n".join(final) + "\n"


def submit(job: dict, sbatch) -> list[str]:
    """Write both scripts into the log folder, queue the array, then the finalize job after it (afterok)."""
    log_dir = Path(job["log_dir"])
    log_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    array_text, final_text = render(job)
    array_path, final_path = log_dir / f"prep-{stamp}.sbatch", log_dir / f"finalize-{stamp}.sbatch"
    array_path.write_text(array_text)
    final_path.write_text(final_text)
    array_id = sbatch(array_path, [])
    return [array_id, sbatch(final_path, [f"--dependency=afterok:{array_id}"])]
