"""`python -m slurm preflight`: a job of a few minutes that runs `python -m megaloop preflight` on the allocation
itself (one torchrun per node through srun, c10d rendezvous on the first node, NCCL with the training job's
defaults), so every communication path a training job takes is checked, and its bus bandwidth measured against the
link's nominal rate (NVLink within a node, InfiniBand across nodes), before the first real job.

The job's output file holds one PASS/FAIL line per path and the summary table (rank 0's), then the exit code: 0
when every path passed. The preflight's data and checkpoints go to a folder inside the job's folder, which every
node must read (a shared file system, as the training job's checkpoints need); it is removed after a pass."""
from __future__ import annotations

import argparse
import shlex

from slurm import body, options
from slurm.script import output_pattern, sbatch_quote
from slurm.spec import default_python
from data_prep.paths import LocalPath

sh = shlex.quote
CPUS_PER_GPU = 8
DEFAULT_NAME = "megaloop-preflight"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("preflight", help="a short job checking every communication path (NCCL) on the cluster",
                       description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--nodes", type=int, required=True, help="nodes (one torchrun per node)")
    per = p.add_mutually_exclusive_group(required=True)
    per.add_argument("--gpus-per-node", type=int, help="GPUs per node, one process each (an even total)")
    per.add_argument("--procs-per-node", type=int, help="CPU cluster: processes per node (gloo)")
    p.add_argument("--partition", required=True, help="Slurm partition (comma list allowed)")
    p.add_argument("--time", required=True, help="time limit, e.g. 00:10:00 (the paths take a few minutes)")
    p.add_argument("--account", help="Slurm account to charge")
    p.add_argument("--job-name", default=DEFAULT_NAME, help=f"job name (default {DEFAULT_NAME})")
    p.add_argument("--out-root", type=LocalPath(), default="runs",
                   help="the job's folder is OUT_ROOT/JOB_NAME (default: runs); it must "
                                                      "be on a file system every node reads")
    p.add_argument("--container", metavar="IMAGE", help="run inside this image (pyxis: srun --container-image)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="export this variable in the job, e.g. --env NCCL_SOCKET_IFNAME=ib0 (repeatable)")
    p.add_argument("--cpus-per-node", type=int, help=f"CPUs per node (default {CPUS_PER_GPU} per GPU)")
    p.add_argument("--min-bw-fraction", type=float, default=0.0, metavar="F",
                   help="fail a path whose bus bandwidth is below F x the link's nominal rate (default 0: report)")
    p.add_argument("--python", help="interpreter on the nodes (default: the one running this command)")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch script instead of submitting it")
    return p


def build(args, argv: list[str]) -> dict:
    """The job's validated facts (one-line OptionError for a bad value)."""
    gpus = options.positive("--gpus-per-node", args.gpus_per_node) if args.gpus_per_node is not None else 0
    procs = gpus or options.positive("--procs-per-node", args.procs_per_node)
    nodes = options.positive("--nodes", args.nodes)
    if (nodes * procs) % 2:
        raise options.OptionError("--nodes", nodes, f"x {procs} processes per node is odd; the tp2 and pp2 paths "
                                                    "pair the processes: use an even total")
    options.time_seconds(args.time)
    if not 0.0 <= args.min_bw_fraction <= 1.0:
        raise options.OptionError("--min-bw-fraction", args.min_bw_fraction, "must be in [0, 1]")
    name = options.job_name(args.job_name)
    folder = f"{options.path('--out-root', args.out_root).rstrip('/')}/{name}"
    container = options.text("--container", args.container) if args.container is not None else None
    cpus = args.cpus_per_node if args.cpus_per_node is not None else (CPUS_PER_GPU * gpus or procs)
    return {"nodes": nodes, "gpus": gpus, "procs": procs, "cpus": options.positive("--cpus-per-node", cpus),
            "time": args.time.strip(), "name": name, "folder": folder, "container": container,
            "partition": options.slurm_name("--partition", args.partition, allow_list=True),
            "account": options.slurm_name("--account", args.account),
            "env": [options.env_assignment(e) for e in args.env], "min_bw": args.min_bw_fraction,
            "python": options.text("--python", args.python) if args.python else default_python(container),
            "command_line": "python -m slurm " + shlex.join(argv)}


def render(job: dict) -> str:
    parts = [_header(job), [""], body.PRELUDE.splitlines(), _variables(job), body.RENDEZVOUS.splitlines(),
             body.NCCL.splitlines() if job["gpus"] else [], _environment(job), _launch(job)]
    return "\n".join(line for part in parts for line in part) + "\n"


def _header(job: dict) -> list[str]:
    lines = ["#!/bin/bash", "# megaloop preflight: every communication path on this allocation, PASS/FAIL with bus "
             "bandwidth", f"#   {job['command_line']}",
             f"# Submit: mkdir -p {sh(job['folder'] + '/slurm')} && sbatch THIS_FILE   (python -m slurm does both)"]
    opts = [("job-name", sbatch_quote(job["name"]))]
    opts += [("partition", sbatch_quote(job["partition"]))] if job["partition"] else []
    opts += [("account", sbatch_quote(job["account"]))] if job["account"] else []
    opts += [("nodes", str(job["nodes"])), ("ntasks-per-node", "1")]
    opts += [("gpus-per-node", str(job["gpus"]))] if job["gpus"] else []
    opts += [("cpus-per-task", str(job["cpus"]))]
    opts += [("exclusive", None), ("mem", "0")] if job["gpus"] else []
    opts += [("time", job["time"]), ("output", sbatch_quote(output_pattern(job["folder"] + "/slurm", "%j.out")))]
    return lines + [f"#SBATCH --{k}" + (f"={v}" if v is not None else "") for k, v in opts]


def _variables(job: dict) -> list[str]:
    preflight = ["-m", "megaloop", "preflight", "--json", "--min-bw-fraction", str(job["min_bw"])]
    if not job["gpus"]:
        preflight += ["--device", "cpu"]
    return ["# The preflight's command line and its folder (data and checkpoints of its runs: shared by the nodes).",
            f"PYTHON={sh(job['python'])}", f"NPROC_PER_NODE={job['procs']}",
            "PREFLIGHT=(" + " ".join(sh(a) for a in preflight) + ")",
            f"WORK_DIR={sh(job['folder'] + '/work')}-$SLURM_JOB_ID", ""]


def _environment(job: dict) -> list[str]:
    lines = ["export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}"]
    if job["env"]:
        lines += ["# Set with --env:"] + [f"export {key}={sh(value)}" for key, value in job["env"]]
    return lines + [""]


def _launch(job: dict) -> list[str]:
    srun = ['srun --kill-on-bad-exit=1 --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 '
            '--cpus-per-task="$SLURM_CPUS_PER_TASK"']
    if job["gpus"]:
        srun.append(f"--gpus-per-node={job['gpus']}")
    if job["container"]:
        srun.append(f"--container-image={sh(job['container'])} --container-mounts=\"$PWD:$PWD\" "
                    '--container-workdir="$PWD"')
    torchrun = ['"$PYTHON" -m torch.distributed.run --nnodes="$SLURM_JOB_NUM_NODES" '
                '--nproc-per-node="$NPROC_PER_NODE"',
                '--rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" '
                '--max-restarts=0',
                '"${PREFLIGHT[@]}" --work-dir "$WORK_DIR"']
    lines = ['mkdir -p "$WORK_DIR"',
             'log "preflight: ${SLURM_JOB_NUM_NODES} node(s) ${SLURM_JOB_NODELIST}, ${NPROC_PER_NODE} processes per '
             'node, rendezvous ${MASTER_ADDR}:${MASTER_PORT}"']
    lines += [srun[0] + " \\"] + [f"    {x} \\" for x in srun[1:]]
    lines += [f"  {torchrun[0]} \\", f"    {torchrun[1]} \\", f"    {torchrun[2]}"]
    return lines + ["RC=$?",
                    'if [ "$RC" = 0 ]; then',
                    '  log "preflight passed: every path PASS (table above); the cluster is ready for training"',
                    '  rm -rf "$WORK_DIR"',
                    "else",
                    '  log "preflight FAILED (exit code $RC): see the FAIL lines or the error above; kept $WORK_DIR"',
                    "fi",
                    'exit "$RC"']
