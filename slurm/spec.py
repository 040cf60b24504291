"""What one sbatch script describes: the allocation, the training command and, for a sweep, the points of its job
array. Built from validated options (slurm/options.py); rendered by slurm/script.py."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Point:
    """One task of a job array: its mu_rec, FLOP budget, the token count that budget buys and the run's folder."""

    index: int
    mu_rec: int
    mu_bwd: int
    budget: float  # FLOPs
    flops_per_token: float
    tokens_per_step: int
    steps: int
    out_dir: str
    overrides: tuple[str, ...] = ()  # what this task adds to the trainer's command line (mu_rec, mu_bwd, steps)

    @property
    def tokens(self) -> float:
        """What the budget buys: budget / FLOPs-per-token (the steps trained are this rounded to whole steps)."""
        return self.budget / self.flops_per_token

    @property
    def trained_tokens(self) -> int:
        return self.steps * self.tokens_per_step


@dataclass
class JobSpec:
    config: str
    nodes: int
    procs_per_node: int  # torchrun workers per node: one per GPU, or CPU processes
    gpus_per_node: int  # 0 on a CPU cluster
    cpus_per_node: int
    time: str
    job_name: str
    out_dir: str  # the run's folder (train.out_dir) of a single job; the sweep's root folder for an array
    partition: str | None = None
    account: str | None = None
    container: str | None = None
    overrides: list[str] = field(default_factory=list)
    env: list[tuple[str, str]] = field(default_factory=list)
    signal_lead: int = 300
    python: str = "python"
    dependency: str | None = None
    requeue: bool = True  # requeue itself after an agreed stop (False: segments of a dependency chain)
    max_failures: int = 3  # failures of the training processes within an hour that end the job FAILED
    points: list[Point] | None = None  # a job array, one task per point
    array_parallel: int | None = None  # at most this many array tasks at once
    command_line: str | None = None  # how the script was rendered, for its header comment

    @property
    def log_dir(self) -> str:
        """Slurm's output files: one folder per job (per sweep for an array), inside the run's folder."""
        return str(Path(self.out_dir) / "slurm")


def default_python(container: str | None) -> str:
    """The interpreter that renders the job also runs it (the same virtual environment on a shared file system),
    written relative to the submit directory when it lies inside it; `python` inside a container image."""
    if container:
        return "python"
    exe = Path(sys.executable)
    try:
        return str(exe.relative_to(Path.cwd()))
    except ValueError:
        return os.path.abspath(exe)
