"""Jobs on the local Slurm cluster (scripts/slurm_cluster.sh up) for the tests: submitting the small parcae-tiny run
(2 CPU processes, fp32) through `python -m slurm`, watching the queue, finding the training processes."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "parcae-tiny.yaml"
REFERENCE_STEPS = 120  # the reference run's steps (tests/slurm/conftest.py), and of every run compared with it


def tiny_overrides(shards: Path, steps: int) -> list[str]:
    return [f"data.shards={shards}", f"train.steps={steps}", "model.vocab_size=512", "model.d_model=64",
            "model.n_heads=2", "model.seq_len=32", "model.ve_gate_channels=16", "data.micro_batch_size=4",
            "data.global_batch_size=8", "data.val_batches=1", "train.val_every=100000", "train.val_depths=[2]",
            "train.progress=false", "train.precision=fp32", "checkpoint.every=10", "parallel.timeout_s=60"]


def slurm_cli(*args: str, cwd: Path = REPO, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurm", *args], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=300)


def cluster_problem() -> str | None:
    """Why the local cluster cannot take jobs, or None when it can."""
    if not shutil.which("sinfo") or not shutil.which("sbatch"):
        return "Slurm's clients (sinfo, sbatch) are not installed: run `bash scripts/slurm_cluster.sh up` as root"
    try:
        state = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer within 20 s: is slurmctld running? (`bash scripts/slurm_cluster.sh up`)"
    states = state.stdout.split()
    if state.returncode != 0 or not any(s.rstrip("*") in ("idle", "mixed", "allocated", "completing")
                                        for s in states):
        detail = (state.stderr.strip() or " ".join(states) or "no nodes").splitlines()[0]
        return f"the local Slurm cluster is not up ({detail}): run `bash scripts/slurm_cluster.sh up` as root"
    return None


def job_state(job_id: str) -> dict[str, str]:
    """scontrol's fields of a job (kept for MinJobAge after it ends; accounting is off, so there is no sacct)."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True).stdout
    fields = {}
    for line in out.splitlines()[:1]:
        for item in line.split():
            key, _, value = item.partition("=")
            fields.setdefault(key, value)
    return fields


def squeue_states(job_id: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout
    return out.split()


def wait_until(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def wait_gone(job_id: str, timeout: float, seen: set | None = None) -> None:
    """Wait until squeue no longer lists the job (every task of an array); `seen` collects the states it showed."""
    def gone():
        states = squeue_states(job_id)
        if seen is not None:
            seen.update(states)
        return not states
    wait_until(gone, timeout, f"job {job_id} to leave the queue", interval=0.5)


def submit(shards: Path, out_root: Path, name: str, steps: int, *extra: str) -> str:
    sets = [a for o in tiny_overrides(shards, steps) for a in ("--set", o)]
    done = slurm_cli("submit", str(TINY), "--nodes", "1", "--procs-per-node", "2", "--partition", "debug",
                     "--time", "10", "--out-root", str(out_root), "--job-name", name, "--python", sys.executable,
                     *sets, *extra)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()[-1]


def train_losses(out_dir: Path) -> dict[int, float]:
    """step -> loss; a step logged twice (before a stop or a crash, then after the resume) keeps its last record."""
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def last_step(out_dir: Path) -> int:
    path = out_dir / "metrics.jsonl"
    if not path.exists():
        return -1
    steps = [json.loads(line).get("step", -1) for line in path.read_text().splitlines() if '"train"' in line]
    return max(steps, default=-1)


def worker_pids(out_dir: Path) -> dict[int, int]:
    """RANK -> pid of the training processes of one run (found by their train.out_dir argument)."""
    needle = f"train.out_dir={out_dir}".encode()
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes()
            if needle not in cmd or b"slurm.agent" in cmd or b"megaloop" not in cmd:
                continue
            env = dict(e.split(b"=", 1) for e in (proc / "environ").read_bytes().split(b"\0") if b"=" in e)
        except OSError:
            continue
        if b"RANK" in env:
            found[int(env[b"RANK"])] = int(proc.name)
    return found


def agent_pid(out_dir: Path) -> int | None:
    """The pid of the run's `python -m slurm.agent` (the torchrun agent srun started), or None."""
    needle = f"train.out_dir={out_dir}".encode()
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes() if proc.name.isdigit() else b""
        except OSError:
            continue
        if needle in cmd and b"slurm.agent" in cmd:
            return int(proc.name)
    return None


def metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def job_log(out_dir: Path, job_id: str) -> str:
    path = out_dir / "slurm" / f"{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else f"(no {path})"

