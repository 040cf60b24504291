"""The agreed stop: SIGTERM to ONE rank of a tp2 x dp2 job (`python -m megaloop train` processes started as a
launcher would, RANK/WORLD_SIZE in the environment): every rank stops at the same step boundary, the checkpoint of
that step is committed, every rank exits with the stop code within 30 s, and re-running the same command continues to
the end with the per-step losses of an uninterrupted run, bit for bit (fp32).

The suite runs the 2 x 2 grid only: the signalled rank (3) shares neither its tp group nor its dp group with rank 0,
so only an agreement over the whole job stops every rank, which a dp2 job (dp group = job) cannot tell apart.
`python benchmarks/agreed_stop.py` runs dp2 and tp2 x dp2."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.pipeline.spawn import die_with_parent, free_port

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "parcae-tiny.yaml"
STOP_EXIT_CODE = 75
STEPS = 16  # SIGTERM once 4 metrics records are logged: the stop lands a step or two later, far from the end


def command(shards, out_dir, tp: int) -> list[str]:
    sets = [f"data.shards={shards}", f"train.out_dir={out_dir}", f"train.steps={STEPS}", "model.vocab_size=512",
            "model.seq_len=32", "data.micro_batch_size=2", "data.global_batch_size=8", "data.val_batches=1",
            "train.val_every=1000", "train.progress=false", "train.precision=fp32", "train.val_depths=[2]",
            f"parallel.tp={tp}"]
    return [sys.executable, "-m", "megaloop", "train", str(TINY)] + [a for s in sets for a in ("--set", s)]


def launch(cmd: list[str], world: int, log_dir: Path) -> list[subprocess.Popen]:
    """One process per rank with a torchrun-like environment (as srun or mpirun would start them)."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        log = open(log_dir / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      preexec_fn=die_with_parent))
    return procs


def wait_all(procs, timeout: float) -> list[int | None]:
    """The exit codes of procs after at most `timeout` seconds; a rank still running then is killed (its code is
    -9), and so is every rank when the wait is interrupted (pytest-timeout, Ctrl-C)."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.poll() for p in procs]


def train_losses(out_dir: Path) -> dict[int, float]:
    """step -> loss; a step logged twice (before a stop, then again after the resume) keeps its last record."""
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def logged_steps(out_dir: Path) -> int:
    path = out_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


CASES = {"dp2": (2, 1), "tp2xdp2": (4, 2)}  # label: (world, tp); the benchmark runs all, the suite the grid
SUITE = ["tp2xdp2"]


@pytest.mark.multiproc
@pytest.mark.parametrize("world,tp", [CASES[label] for label in SUITE], ids=SUITE)
def test_sigterm_to_one_rank_stops_all_at_one_step(world, tp, tiny_shards, tmp_path):
    straight = tmp_path / "straight"
    procs = launch(command(tiny_shards, straight, tp), world, tmp_path)
    assert wait_all(procs, 600) == [0] * world, (tmp_path / "rank0.log").read_text()[-3000:]

    out = tmp_path / "stopped"
    procs = launch(command(tiny_shards, out, tp), world, tmp_path)
    deadline = time.monotonic() + 300
    while logged_steps(out) < 4 and time.monotonic() < deadline and procs[0].poll() is None:
        time.sleep(0.1)
    victim = world - 1
    sent = time.monotonic()
    procs[victim].send_signal(signal.SIGTERM)
    codes = wait_all(procs, 30)
    elapsed = time.monotonic() - sent
    log = (tmp_path / "rank0.log").read_text()
    print(f"{world} ranks, SIGTERM to rank {victim}: exit codes {codes} after {elapsed:.1f} s")
    assert codes == [STOP_EXIT_CODE] * world, log[-3000:]
    assert elapsed < 30
    latest = (out / "checkpoints" / "latest").read_text().strip()
    step = int(latest.split("_")[-1])
    assert 0 < step < STEPS and (out / "checkpoints" / latest / "COMMIT").is_file()
    assert f"stopped after step {step}" in log
    # rank 0 writes the marker; the signal reached rank 3 only, and every rank learns which one it was
    assert json.loads((out / "STOPPED").read_text())["reason"] == "SIGTERM"

    procs = launch(command(tiny_shards, out, tp), world, tmp_path)
    assert wait_all(procs, 600) == [0] * world, (tmp_path / "rank0.log").read_text()[-3000:]
    reference, resumed = train_losses(straight), train_losses(out)
    print(f"stopped at step {step}, resumed to {STEPS}: losses identical to the uninterrupted run: "
          f"{resumed == reference}")
    assert sorted(resumed) == list(range(STEPS))
    assert resumed == reference
