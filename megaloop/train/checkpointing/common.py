"""What every part of the trainer's checkpointing shares: the exit code of a saved stop, the metadata version, the
errors, where a run's checkpoints live, and the one-line notes rank 0 prints."""
from __future__ import annotations

import sys
from pathlib import Path

from megaloop.config import Config
from megaloop.train.protocols import TrainerRuntime

STOP_EXIT_CODE = 75  # sysexits' EX_TEMPFAIL: the run stopped early on request and saved; run it again to continue
METADATA_VERSION = 1


class ResumeError(ValueError):
    """A checkpoint that cannot continue this run (another model, nothing loadable, an out_dir already used)."""


class SaveFailed(RuntimeError):
    """A checkpoint that had to land did not: the final or stop save, or periodic saves failing in a row. The job
    exits non-zero and leaves no COMPLETED/STOPPED marker, so that a batch script neither marks the run done nor
    requeues it as if it had saved."""


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.train.out_dir) / "checkpoints"


def note(runtime: TrainerRuntime, message: str) -> None:
    """One line on stderr, from rank 0 only."""
    if runtime.is_main:
        print(f"megaloop: {message}", file=sys.stderr, flush=True)
