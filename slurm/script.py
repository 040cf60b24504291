"""Render the sbatch script of a training job (or of a sweep's job array) from a JobSpec.

Every user-supplied string reaches the script in one of two quoted forms and is never executed: in `#SBATCH` lines
(which sbatch, not a shell, parses) as a double-quoted value with `\\` and `"` escaped, and `%` doubled where Slurm
expands file-name patterns; in the script's body as one shell word made by shlex.quote (single quotes), e.g.
`$(touch x)` stays those eight characters. The body's fixed parts (trap, launch, requeue) are in slurm/body.py."""
from __future__ import annotations

import shlex

from slurm import body
from slurm.spec import JobSpec, Point

sh = shlex.quote


def sbatch_quote(value: str) -> str:
    """A value for an `#SBATCH` line: sbatch splits those lines on blanks and honours double quotes and backslash."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def output_pattern(folder: str, name: str) -> str:
    """--output inside `folder`: `%` in the folder's own name doubled, so that only our %j/%A/%a are patterns."""
    return folder.replace("%", "%%").rstrip("/") + "/" + name


def render(spec: JobSpec) -> str:
    parts = [["#!/bin/bash"], _header_comment(spec), _sbatch_lines(spec), [""], body.PRELUDE.splitlines(),
             _run_variables(spec), _environment(spec), body.DEADLINE_AND_TRAP.splitlines(), _launch(spec),
             body.OUTCOME.splitlines()]
    return "\n".join(line for part in parts for line in part) + "\n"


def _header_comment(spec: JobSpec) -> list[str]:
    kind = "isoFLOP sweep (job array)" if spec.points else "training job"
    lines = [f"# megaloop {kind}, rendered by `python -m slurm`"]
    if spec.command_line:
        lines.append(f"#   {spec.command_line}")
    lines += [f"# Submit: mkdir -p {sh(spec.log_dir)} && sbatch THIS_FILE   (python -m slurm does both)",
              "# Preempt (save, requeue, resume): scancel --signal=USR1 --batch JOBID   Watch: squeue --me; tail -f "
              "the output file"]
    if spec.points:
        lines += ["# Points (one array task each; steps = round(tokens / tokens per step), tokens from megaloop's "
                  "FLOP model):"]
        lines += ["#   " + row for row in points_table(spec.points)]
    return lines


def points_table(points: list[Point]) -> list[str]:
    head = (f"{'task':>4} {'mu_rec':>6} {'mu_bwd':>6} {'budget':>9} {'FLOPs/token':>11} {'tokens':>11} "
            f"{'steps':>8}  out_dir")
    rows = [f"{p.index:>4} {p.mu_rec:>6} {p.mu_bwd:>6} {p.budget:>9.3g} {p.flops_per_token:>11.4g} "
            f"{p.tokens:>11.4g} {p.steps:>8}  {p.out_dir}" for p in points]
    return [head, *rows]


def _sbatch_lines(spec: JobSpec) -> list[str]:
    opts = [("job-name", sbatch_quote(spec.job_name))]
    if spec.partition:
        opts.append(("partition", sbatch_quote(spec.partition)))
    if spec.account:
        opts.append(("account", sbatch_quote(spec.account)))
    opts += [("nodes", str(spec.nodes)), ("ntasks-per-node", "1")]
    if spec.gpus_per_node:
        opts += [("gpus-per-node", str(spec.gpus_per_node))]
    opts.append(("cpus-per-task", str(spec.cpus_per_node)))
    if spec.gpus_per_node:
        opts += [("exclusive", None), ("mem", "0")]
    opts += [("time", spec.time), ("signal", f"B:USR1@{spec.signal_lead}")]
    opts.append(("requeue", None))
    opts.append(("open-mode", "append"))
    if spec.points:
        limit = f"%{spec.array_parallel}" if spec.array_parallel else ""
        opts.append(("array", f"0-{len(spec.points) - 1}{limit}"))
        opts.append(("output", sbatch_quote(output_pattern(spec.log_dir, "%A_%a.out"))))
    else:
        opts.append(("output", sbatch_quote(output_pattern(spec.log_dir, "%j.out"))))
    if spec.dependency:
        opts.append(("dependency", spec.dependency))
    return [f"#SBATCH --{k}" + (f"={v}" if v is not None else "") for k, v in opts]


def _run_variables(spec: JobSpec) -> list[str]:
    train = ["-m", "megaloop", "train", spec.config]
    for o in spec.overrides:
        train += ["--set", o]
    lines = ["# The run: the trainer's command line (one quoted word per argument) and its folder.",
             f"PYTHON={sh(spec.python)}",
             f"NPROC_PER_NODE={spec.procs_per_node}",
             f"REQUEUE={1 if spec.requeue else 0}",
             f"MAX_FAILURES={spec.max_failures}",
             "TRAIN=(" + " ".join(sh(a) for a in train) + ")"]
    if not spec.points:
        return lines + [f"OUT_DIR={sh(spec.out_dir)}", "POINT=()", ""]
    lines += ['case "${SLURM_ARRAY_TASK_ID:?this script is a job array: sbatch it as rendered (--array)}" in']
    for p in spec.points:
        point = [a for o in p.overrides for a in ("--set", o)]
        lines.append(f"  {p.index}) OUT_DIR={sh(p.out_dir)}; POINT=(" + " ".join(sh(a) for a in point) + ") ;;")
    lines += ['  *) echo "no point $SLURM_ARRAY_TASK_ID in this sweep" >&2; exit 2 ;;', "esac", ""]
    return lines


def _environment(spec: JobSpec) -> list[str]:
    lines = body.RENDEZVOUS.splitlines()
    if spec.gpus_per_node:
        lines += body.NCCL.splitlines()
    lines.append("export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}")
    if spec.env:
        lines.append("# Set with --env:")
        lines += [f"export {key}={sh(value)}" for key, value in spec.env]
    return lines + [""]


def _launch(spec: JobSpec) -> list[str]:
    srun = ['srun --kill-on-bad-exit=1 --nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 '
            '--cpus-per-task="$SLURM_CPUS_PER_TASK"']
    if spec.gpus_per_node:
        srun.append(f"--gpus-per-node={spec.gpus_per_node}")
    if spec.container:
        srun.append(f"--container-image={sh(spec.container)} --container-mounts=\"$PWD:$PWD\" "
                    '--container-workdir="$PWD"')
    agent = ['"$PYTHON" -m slurm.agent --failures="$OUT_DIR/failures.jsonl" --max-failures="$MAX_FAILURES"',
             '--nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node="$NPROC_PER_NODE" --max-restarts="$MAX_FAILURES"',
             '--rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID"',
             '"${TRAIN[@]}" "${POINT[@]}" --set "train.out_dir=$OUT_DIR" &']
    lines = [srun[0] + " \\"] + [f"    {x} \\" for x in srun[1:]]
    lines += [f"  {agent[0]} \\"] + [f"    {x} \\" for x in agent[1:-1]] + [f"    {agent[-1]}"]
    return body.LAUNCH_HEAD.splitlines() + lines + body.LAUNCH_TAIL.splitlines()
