"""Per-rank heartbeat files: what `megaloop status` reads to show a job's progress, stragglers and hung ranks, and
what a restarted attempt reads to say which rank stopped first and how many steps were lost.

Every rank appends one JSON line to <out_dir>/heartbeat/rank_<RANK>.jsonl:
  {"event": "start", "rank", "node", "pid", "attempt", "step", "time"}   when its attempt starts training
  {"event": "step", "rank", "node", "pid", "attempt", "step", "step_time", "time"}   every train.heartbeat_every
      steps (and after the last step), where step is the last completed step (counted from 1: the run's steps done),
      step_time the mean wall time of this rank's steps since its previous line and busy_time the mean of its own
      time in them (from the step's start until it is ready for the step's job-wide reduction: its data, forward and
      backward; ranks wait for each other after that point, so wall times are alike on every rank and a straggler
      shows in busy_time only), in seconds
  {"event": "end", ...}   when the attempt leaves the training loop normally (completed, stopped or rolled back)
`attempt` names the attempt (Slurm job id, Slurm restart count and torchrun restart count), `time` is unix time.
A line is written and flushed at once (no buffering), so that a rank killed mid-step leaves its last line behind; the
files are local to each rank's writes (no communication), so a straggler or a hung rank shows in its own file.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

FOLDER = "heartbeat"


def attempt_id(environ=None) -> str:
    """This attempt of the job: Slurm's job id and restart count, and torchrun's restart count (what changes when a
    job is requeued or restarted in place)."""
    env = os.environ if environ is None else environ
    return (f"{env.get('SLURM_JOB_ID', 'local')}.{env.get('SLURM_RESTART_COUNT', '0')}."
            f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}")


def heartbeat_path(out_dir: str | Path, rank: int) -> Path:
    return Path(out_dir) / FOLDER / f"rank_{rank}.jsonl"


class Heartbeat:
    """One rank's heartbeat writer (see the module docstring); every_steps 0 writes none."""

    def __init__(self, out_dir: str | Path, rank: int, every_steps: int, clock=time.time):
        self.every, self.rank, self.clock = every_steps, rank, clock
        self.path = heartbeat_path(out_dir, rank)
        self._base = {"rank": rank, "node": socket.gethostname(), "pid": os.getpid(), "attempt": attempt_id()}
        self._steps, self._seconds, self._busy = 0, 0.0, 0.0
        self._file = None

    def _write(self, event: str, **fields) -> None:
        if not self.every:
            return
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)
        self._file.write(json.dumps({"event": event, **self._base, **fields, "time": self.clock()}) + "\n")
        self._file.flush()

    def start(self, step: int) -> None:
        """The attempt starts training with `step` steps done."""
        self._write("start", step=step)

    def ready(self, seconds: float) -> None:
        """This rank is ready for the step's reduction, `seconds` after the step started (its busy time)."""
        self._busy += seconds

    def beat(self, steps_done: int, seconds: float, last: bool = False) -> None:
        """One step finished (steps_done in all, `seconds` of wall time): a line every `every` steps, or now (last)."""
        self._steps += 1
        self._seconds += seconds
        if self.every and (steps_done % self.every == 0 or last):
            self._flush_steps(steps_done)

    def _flush_steps(self, steps_done: int) -> None:
        self._write("step", step=steps_done, step_time=self._seconds / self._steps,
                    busy_time=self._busy / self._steps)
        self._steps, self._seconds, self._busy = 0, 0.0, 0.0

    def close(self, steps_done: int) -> None:
        """The attempt leaves the training loop normally."""
        if self._steps:
            self._flush_steps(steps_done)
        self._write("end", step=steps_done)
        if self._file is not None:
            self._file.close()
            self._file = None


def read_heartbeats(out_dir: str | Path) -> dict[int, list[dict]]:
    """rank -> its heartbeat lines, oldest first (a torn last line, from a rank killed while writing, is left out)."""
    from megaloop.train.metrics import read_json_lines

    folder = Path(out_dir) / FOLDER
    found: dict[int, list[dict]] = {}
    for path in sorted(folder.glob("rank_*.jsonl")) if folder.is_dir() else []:
        try:
            found[int(path.stem.split("_", 1)[1])] = read_json_lines(path)
        except ValueError:
            continue
    return found
