"""`python -m slurm submit|sweep|preflight|prep`: render a megaloop training job (or an isoFLOP job array, a
preflight job checking the cluster's communication paths, or data preparation as a job array) as an sbatch
script, print it (--dry-run) or submit it and print the job id. Wrong values end with one line and exit code 2."""
from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import time
from pathlib import Path

from slurm import options, prep, preflight, script, sweep
from slurm.ask import FlopsError, check, costs
from slurm.failures import DEFAULT_MAX_FAILURES
from slurm.options import OptionError
from slurm.spec import JobSpec, default_python
from data_prep.paths import LocalPath

CPUS_PER_GPU = 8
MIN_TRAIN_S = 120  # a job must be able to train at least this long before its stop signal


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", type=LocalPath(),
                   help="megaloop YAML config, e.g. configs/parcae-1_3b.yaml (a path the job can read)")
    p.add_argument("--nodes", type=int, required=True, help="nodes (one torchrun per node)")
    per = p.add_mutually_exclusive_group(required=True)
    per.add_argument("--gpus-per-node", type=int, help="GPUs per node, one training process each")
    per.add_argument("--procs-per-node", type=int, help="CPU cluster: training processes per node (no GPUs)")
    p.add_argument("--partition", required=True, help="Slurm partition (comma list allowed)")
    p.add_argument("--time", required=True, help="time limit per job: MM, HH:MM:SS, D-HH:MM:SS ... the job saves "
                                                 "and requeues itself before it")
    p.add_argument("--account", help="Slurm account to charge")
    p.add_argument("--job-name", help="job name; also names the run's folder under --out-root (default: the "
                                      "config's file name)")
    p.add_argument("--container", metavar="IMAGE", help="run inside this image (pyxis/enroot: srun --container-image),"
                                                        " with the submit directory mounted at the same path")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="megaloop config override, e.g. --set train.steps=100000 (repeatable)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="export this variable in the job, e.g. --env NCCL_SOCKET_IFNAME=ib0 (repeatable)")
    p.add_argument("--out-root", type=LocalPath(), default="runs",
                   help="runs go to OUT_ROOT/JOB_NAME (default: runs); Slurm's output "
                                                      "files to its slurm/ folder")
    p.add_argument("--cpus-per-node", type=int, help=f"CPUs for the torchrun of each node (default: "
                                                     f"{CPUS_PER_GPU} per GPU, or one per CPU process)")
    p.add_argument("--signal-lead", type=int, default=300, metavar="SECONDS",
                   help="USR1 this long before the time limit: stop, save and requeue (default 300)")
    p.add_argument("--python", help="interpreter on the nodes (default: the one running this command, or `python` "
                                    "in a container)")
    p.add_argument("--dependency", help="Slurm dependency of the (first) job, e.g. afterany:12345")
    p.add_argument("--segments", type=int, default=1, help="submit K jobs of the same run, each after the previous "
                                                           "(afterany); a stop then ends a segment instead of "
                                                           "requeueing it (default 1)")
    p.add_argument("--max-failures", type=int, default=DEFAULT_MAX_FAILURES, metavar="N",
                   help="failures of the training processes within an hour (a rank killed, out of memory, hung or "
                        "raising) after which the job ends FAILED instead of restarting them from the newest "
                        f"checkpoint; counted over in-job restarts and requeues in OUT_DIR/failures.jsonl (default "
                        f"{DEFAULT_MAX_FAILURES})")
    p.add_argument("--no-check", action="store_true", help="skip `python -m megaloop check` of the config for the "
                                                           "job's process count (run here before submitting)")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch script instead of submitting it (a "
                                                          "config megaloop refuses is then only a warning)")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m slurm", description=__doc__.split("\n\n")[0].replace("\n", " "))
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("submit", help="one training job: sbatch script, preemption-safe (save, requeue, resume)",
                       description="Render (and submit) the sbatch script of one megaloop training run.")
    _add_common(p)
    s = sub.add_parser("sweep", help="an isoFLOP grid (mu_rec x FLOP budgets) as one job array",
                       description="Render (and submit) an isoFLOP grid as one job array: each task trains one "
                                   "(mu_rec, budget) point for budget / FLOPs-per-token tokens (megaloop's FLOP "
                                   "model) in its own out_dir.")
    _add_common(s)
    s.add_argument("--mu-rec", required=True, help="mean recurrences to sweep, e.g. 2,4,8,16")
    s.add_argument("--flops", required=True, help="FLOP budgets, e.g. 1e18,3e18")
    s.add_argument("--mu-bwd", default="half", help="loop steps with gradient at each point: half (ceil(mu_rec/2), "
                                                     "default), config (the config's value) or an integer")
    s.add_argument("--array-parallel", type=int, help="run at most this many tasks at once (--array=0-K%%N)")
    preflight.add_parser(sub)
    prep.add_parser(sub)
    return ap


def build_spec(args, argv: list[str]) -> JobSpec:
    config = options.text("CONFIG", args.config)
    if not Path(config).is_file():
        raise OptionError("CONFIG", config, "no such file (give the path of a megaloop YAML config)")
    name = options.job_name(args.job_name or (Path(config).stem + ("-isoflop" if args.command == "sweep" else "")))
    overrides = [options.override(o) for o in args.overrides]
    out_root = options.path("--out-root", args.out_root)
    given_out = options.set_keys(overrides).get("train.out_dir")
    out_dir = options.path("--set train.out_dir", given_out) if given_out else str(Path(out_root) / name)
    gpus = options.positive("--gpus-per-node", args.gpus_per_node) if args.gpus_per_node is not None else 0
    procs = gpus or options.positive("--procs-per-node", args.procs_per_node)
    cpus = args.cpus_per_node if args.cpus_per_node is not None else (CPUS_PER_GPU * gpus or procs)
    limit = options.time_seconds(args.time)
    lead = options.positive("--signal-lead", args.signal_lead, maximum=65535)
    if limit < lead + MIN_TRAIN_S:
        lower = f" or lower --signal-lead to {limit - MIN_TRAIN_S}" if limit > MIN_TRAIN_S else ""
        raise OptionError("--time", args.time, f"leaves less than {MIN_TRAIN_S} s of training before the stop signal "
                                               f"{lead} s before the limit; raise --time to "
                                               f"{options.slurm_time(lead + MIN_TRAIN_S)}{lower}")
    container = options.text("--container", args.container) if args.container is not None else None
    return JobSpec(
        config=config, nodes=options.positive("--nodes", args.nodes), procs_per_node=procs, gpus_per_node=gpus,
        cpus_per_node=options.positive("--cpus-per-node", cpus), time=args.time.strip(), job_name=name,
        out_dir=out_dir, partition=options.slurm_name("--partition", args.partition, allow_list=True),
        account=options.slurm_name("--account", args.account), container=container, overrides=overrides,
        env=[options.env_assignment(e) for e in args.env],
        signal_lead=lead,
        python=options.text("--python", args.python) if args.python else default_python(container),
        dependency=options.dependency(args.dependency),
        requeue=options.positive("--segments", args.segments) == 1,
        max_failures=options.positive("--max-failures", args.max_failures, maximum=1000),
        command_line="python -m slurm " + shlex.join(argv))


def add_points(spec: JobSpec, args) -> None:
    """The sweep's grid: each point sets model.mu_rec, model.mu_bwd (--mu-bwd), train.steps and train.out_dir."""
    taken = sorted(set(options.set_keys(spec.overrides)) & {"model.mu_rec", "model.mu_bwd", "train.steps",
                                                            "train.out_dir"})
    if taken:
        raise OptionError("--set", taken[0], "is set by the sweep for each point; leave it out (--mu-bwd chooses "
                                             "mu_bwd, --out-root the folders)")
    mu_values = sweep.parse_list("--mu-rec", args.mu_rec, int)
    budgets = sweep.parse_list("--flops", args.flops, float)
    if args.array_parallel is not None:
        spec.array_parallel = options.positive("--array-parallel", args.array_parallel)
    fixed = sweep.mu_bwd_override(args.mu_bwd)
    spec.points = sweep.grid(mu_values, budgets, costs(spec.config, spec.overrides + fixed, mu_values), spec.out_dir,
                             fixed)


def check_config(spec: JobSpec, warn_only: bool) -> None:
    """megaloop validates the config for the job's world size (a sweep: its first point) before anything is queued."""
    overrides = list(spec.overrides)
    if spec.points:
        overrides += list(spec.points[0].overrides)
    world = spec.nodes * spec.procs_per_node
    problem = check(spec.config, overrides, world)
    if problem and warn_only:
        print(f"slurm: warning: megaloop refuses this config for {world} processes: {problem}", file=sys.stderr)
    elif problem:
        raise OptionError("CONFIG", spec.config, f"megaloop refuses it for {world} processes: {problem} (--no-check "
                                                 "submits anyway)")


def submit(spec: JobSpec, text: str, segments: int) -> list[str]:
    """Write the script into the run's slurm/ folder and sbatch it `segments` times, chained with afterany. When
    nothing was queued the script is removed again (and the folder, if this call made it): a failed submission
    leaves nothing in the run's folder."""
    log_dir = Path(spec.log_dir)
    made = [d for d in (log_dir, *log_dir.parents) if not d.exists()]
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"job-{time.strftime('%Y%m%d-%H%M%S')}.sbatch"
    path.write_text(text)
    ids: list[str] = []
    try:
        for _ in range(segments):
            ids.append(_sbatch(path, [f"--dependency=afterany:{ids[-1]}"] if ids else []))
    except RuntimeError as err:
        if not ids:
            path.unlink(missing_ok=True)
            for folder in made:  # innermost first; only the empty folders this call created
                if folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()
            raise
        raise RuntimeError(f"{err}; queued before it: {', '.join(ids)} (script: {path})") from None
    return ids


def _sbatch(path: Path, extra: list[str]) -> str:
    """Submit the script once; its job id."""
    try:
        done = subprocess.run(["sbatch", "--parsable", *extra, str(path)], capture_output=True, text=True)
    except FileNotFoundError:
        raise RuntimeError("sbatch not found: run this on a Slurm login node (--dry-run prints the script)") from None
    if done.returncode != 0:
        raise RuntimeError(f"sbatch failed: {(done.stderr or done.stdout).strip()}; nothing was queued by this "
                           "submission")
    return done.stdout.strip().split(";")[0]


def _preflight(args, argv: list[str]) -> int:
    """Render the preflight job; print it (--dry-run) or write it to its folder's slurm/ and sbatch it."""
    job = preflight.build(args, argv)
    text = preflight.render(job)
    if args.dry_run:
        sys.stdout.write(text)
        return 0
    log_dir = Path(job["folder"]) / "slurm"
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / f"preflight-{time.strftime('%Y%m%d-%H%M%S')}.sbatch"
    path.write_text(text)
    try:
        print(_sbatch(path, []))
    except RuntimeError:
        path.unlink(missing_ok=True)
        raise
    return 0


def _prep(args, argv: list[str]) -> int:
    """Render the prep array and its finalize job; print them (--dry-run) or submit both."""
    job = prep.build(args, argv)
    if args.dry_run:
        sys.stdout.write("".join(prep.render(job)))
        return 0
    array_id, final_id = prep.submit(job, _sbatch)
    print(f"{array_id}\n{final_id}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(argv)
    try:
        if args.command == "preflight":
            return _preflight(args, argv)
        if args.command == "prep":
            return _prep(args, argv)
        spec = build_spec(args, argv)
        if args.command == "sweep":
            add_points(spec, args)
        if not args.no_check:
            check_config(spec, args.dry_run)
        text = script.render(spec)
        if args.dry_run:
            sys.stdout.write(text)
            return 0
        for job_id in submit(spec, text, args.segments):
            print(job_id)
        return 0
    except (OptionError, FlopsError) as err:
        print(f"slurm: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `--dry-run | head`: the reader went away; stop quietly
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (RuntimeError, OSError) as err:
        print(f"slurm: {err}", file=sys.stderr)
        return 1
