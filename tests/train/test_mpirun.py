"""`mpirun -n 4 python -m megaloop train` (Open MPI; ranks and the rendezvous address through mpi4py, no torchrun)
trains parcae-tiny under tp2 x dp2 with the per-step losses of the same job started as 4 processes with
torchrun-style environment variables, exactly (fp32, same layout, same reduction order)."""
from __future__ import annotations

import os
import shutil

import pytest

from tests.process_group import run_group
from tests.train.test_agreed_stop import REPO, command, launch, train_losses, wait_all

# 8 steps: a rank or address taken wrongly from MPI changes the first step's loss or hangs the rendezvous
SHORT = ["--set", "train.steps=8"]


@pytest.mark.multiproc
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI's mpirun (scripts/setup.sh installs it)")
def test_mpirun_equals_env_launch(tiny_shards, tmp_path):
    procs = launch(command(tiny_shards, tmp_path / "env", tp=2) + SHORT, 4, tmp_path)
    assert wait_all(procs, 600) == [0] * 4, (tmp_path / "rank0.log").read_text()[-3000:]

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    mpirun = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "4", "-x", "OMP_NUM_THREADS", "-x",
              "PYTHONPATH"]
    done = run_group(mpirun + command(tiny_shards, tmp_path / "mpi", tp=2) + SHORT, cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    reference, got = train_losses(tmp_path / "env"), train_losses(tmp_path / "mpi")
    print(f"mpirun -n 4 (tp2 x dp2): {len(got)} steps, losses {got[0]:.6f} .. {got[max(got)]:.6f}; identical to "
          f"the env-launched job: {got == reference}")
    assert sorted(got) == list(range(8))
    assert got == reference
