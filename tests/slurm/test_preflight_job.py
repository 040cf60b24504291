"""`python -m slurm preflight --dry-run`: the rendered job runs `python -m megaloop preflight` through srun and
torchrun's c10d rendezvous on every node of the allocation, with the NCCL defaults, and is valid bash; bad values
are one line and exit code 2."""
from __future__ import annotations

import subprocess

import pytest

from slurm.cli import main

ARGS = ["preflight", "--nodes", "2", "--gpus-per-node", "8", "--partition", "P", "--time", "00:10:00"]


def render(capsys, *extra: str) -> str:
    assert main([*ARGS, *extra, "--dry-run"]) == 0
    return capsys.readouterr().out


def test_gpu_preflight_job(capsys, tmp_path):
    text = render(capsys, "--min-bw-fraction", "0.5", "--env", "NCCL_SOCKET_IFNAME=ib0")
    lines = text.splitlines()
    for option in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8", "--cpus-per-task=64", "--exclusive",
                   "--time=00:10:00", '--partition="P"', '--output="runs/megaloop-preflight/slurm/%j.out"'):
        assert f"#SBATCH {option}" in lines, option
    assert not any("requeue" in line or "signal" in line for line in lines if line.startswith("#SBATCH"))
    srun = next(i for i, line in enumerate(lines) if line.startswith("srun "))
    assert '--nodes="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1' in lines[srun]
    assert lines[srun + 1].strip() == "--gpus-per-node=8 \\"
    launch = " ".join(lines[srun:srun + 5])
    for part in ('-m torch.distributed.run --nnodes="$SLURM_JOB_NUM_NODES" --nproc-per-node="$NPROC_PER_NODE"',
                 '--rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID"',
                 '"${PREFLIGHT[@]}" --work-dir "$WORK_DIR"'):
        assert part in launch, part
    assert "NPROC_PER_NODE=8" in lines and "export NCCL_DEBUG=${NCCL_DEBUG:-WARN}" in lines
    assert "PREFLIGHT=(-m megaloop preflight --json --min-bw-fraction 0.5)" in lines
    assert "export NCCL_SOCKET_IFNAME=ib0" in lines and lines[-1] == 'exit "$RC"'
    (tmp_path / "job.sh").write_text(text)
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sh")]).returncode == 0


def test_cpu_preflight_job_uses_gloo(capsys):
    assert main(["preflight", "--nodes", "1", "--procs-per-node", "4", "--partition", "debug", "--time", "5",
                 "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "PREFLIGHT=(-m megaloop preflight --json --min-bw-fraction 0.0 --device cpu)" in text
    assert "gpus-per-node" not in text and "NCCL_DEBUG" not in text


@pytest.mark.parametrize("extra, key", [(["--time", "soon"], "--time"), (["--nodes", "3", "--gpus-per-node", "1"],
                                                                         "--nodes"),
                                        (["--min-bw-fraction", "1.5"], "--min-bw-fraction")])
def test_bad_values_are_one_line(capsys, extra, key):
    args = ARGS + extra
    if "--gpus-per-node" in extra:
        args = ["preflight", "--partition", "P", "--time", "10"] + extra
    assert main([*args, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("slurm: ") and err.count("\n") == 1 and key in err
