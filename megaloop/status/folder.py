"""Reading a run folder (train.out_dir) for `megaloop status`: its config.json, the COMPLETED/STOPPED markers,
summary.json, the restart and rollback records of metrics.jsonl, the heartbeat files, and for a Slurm job its log
under <run>/slurm and its state in the queue. Everything is read as it is while the job may be writing it: a torn
last line is left out, and a file that disappears between listing and reading counts as absent."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from megaloop.status.assess import Limits
from megaloop.train.heartbeat import FOLDER as HEARTBEAT_FOLDER, read_heartbeats
from megaloop.train.metrics import read_json_lines

RUN_FILES = ("config.json", "metrics.jsonl", HEARTBEAT_FOLDER, "COMPLETED", "STOPPED", "summary.json")
SQUEUE_TIMEOUT_S = 5.0
JOB_LOG_PREFIX = "[megaloop-job"  # the batch script's own lines (slurm/body.py `log`)


class NotARun(ValueError):
    """The folder is missing or holds none of a run's files."""


@dataclass
class RunFolder:
    path: Path
    config: dict = field(default_factory=dict)
    markers: dict[str, dict] = field(default_factory=dict)  # COMPLETED / STOPPED -> its JSON
    summary: dict | None = None
    restarts: list[dict] = field(default_factory=list)
    rollbacks: list[dict] = field(default_factory=list)
    heartbeats: dict[int, list[dict]] = field(default_factory=dict)
    quiet_s: float | None = None  # seconds since the newest write to the folder's run files
    nccl_dumps: list[str] = field(default_factory=list)  # the NCCL flight recorder's dumps (<run>/nccl_trace)


def _json_file(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else {}


def _quiet_s(path: Path, now: float) -> float | None:
    times = []
    for name in RUN_FILES:
        target = path / name
        paths = list(target.glob("*")) + [target] if target.is_dir() else [target]
        for p in paths:
            try:
                times.append(p.stat().st_mtime)
            except OSError:
                continue
    return max(0.0, now - max(times)) if times else None


def read_folder(path: Path, now: float | None = None) -> RunFolder:
    """The run's files (see the module docstring); NotARun when there is no run there."""
    path = Path(path)
    if not path.is_dir():
        raise NotARun(f"{path}: no such folder; pass a run's folder (its train.out_dir)")
    if not any((path / name).exists() for name in RUN_FILES) and not list(path.glob("slurm/job-*.sbatch")):
        raise NotARun(f"{path}: not a run folder (none of {', '.join(RUN_FILES)}, nor a Slurm job's "
                      "slurm/job-*.sbatch); pass a run's train.out_dir, e.g. runs/<name>")
    run = RunFolder(path, config=_json_file(path / "config.json") or {}, summary=_json_file(path / "summary.json"))
    for name in ("COMPLETED", "STOPPED"):
        info = _json_file(path / name)
        if info is not None or (path / name).exists():
            run.markers[name] = info or {}
    records = read_json_lines(path / "metrics.jsonl")
    run.restarts = [r for r in records if r.get("kind") == "restart"]
    run.rollbacks = [r for r in records if r.get("kind") == "rollback"]
    run.heartbeats = read_heartbeats(path)
    run.quiet_s = _quiet_s(path, time.time() if now is None else now)
    trace = path / "nccl_trace"
    run.nccl_dumps = sorted(p.name for p in trace.iterdir() if p.is_file()) if trace.is_dir() else []
    return run


def limits_of(config: dict) -> Limits:
    """The timing limits of a run's config.json; the config defaults for what it lacks."""
    parallel, train = config.get("parallel") or {}, config.get("train") or {}
    base = Limits()

    def number(section: dict, key: str, default):
        value = section.get(key)
        return value if isinstance(value, (int, float)) and not isinstance(value, bool) else default
    return Limits(timeout_s=float(number(parallel, "timeout_s", base.timeout_s)),
                  startup_timeout_s=float(number(parallel, "startup_timeout_s", base.startup_timeout_s)),
                  heartbeat_every=int(number(train, "heartbeat_every", base.heartbeat_every)),
                  steps=number(train, "steps", None))


def process_state(node: str, pid) -> str:
    """A rank's process as this machine sees it, where it runs here: alive, stopped (SIGSTOP or a debugger), zombie
    or gone; "" on another node (or no pid). A pid the system has reused since reads as alive."""
    if not isinstance(pid, int) or node != socket.gethostname():
        return ""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return "gone"
    except OSError:  # no /proc: ask the kernel whether the pid exists
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "gone"
        except PermissionError:
            pass
        return "alive"
    return {"T": "stopped", "t": "stopped", "Z": "zombie", "X": "gone"}.get(fields[0], "alive")


def slurm_job(path: Path, attempt: str | None) -> dict | None:
    """For a run under Slurm: its job id (from the current attempt, else the newest log under <run>/slurm), the log,
    the batch script's last line there, and the job's state in the queue (squeue; "" where squeue is not installed,
    "not in the queue" once Slurm has forgotten it)."""
    logs = sorted((path / "slurm").glob("*.out"), key=lambda p: p.stat().st_mtime) if (path / "slurm").is_dir() \
        else []
    job = attempt.split(".")[0] if attempt and not attempt.startswith("local.") else None
    if job is None and not logs:
        return None
    log = next((p for p in logs if job and p.stem == job), logs[-1] if logs else None)
    job = job or (log.stem if log is not None else None)
    lines = [x for x in _text(log).splitlines() if x.startswith(JOB_LOG_PREFIX)] if log is not None else []
    return {"job": job, "log": str(log) if log is not None else "", "last_line": lines[-1] if lines else "",
            "queue": _queue_state(job)}


def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _queue_state(job: str | None) -> str:
    if not job:
        return ""
    try:
        done = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True,
                              timeout=SQUEUE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    states = done.stdout.split()
    if done.returncode == 0 and states:
        return ",".join(sorted(set(states)))
    return "not in the queue" if done.returncode == 0 or "Invalid job id" in done.stderr else ""
