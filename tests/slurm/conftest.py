"""The local Slurm cluster for tests/slurm: the `slurm` marker, a fixture that skips, with the reason, when the
cluster cannot take jobs, and the uninterrupted reference run that the preemption and recovery tests compare with
(submitted once per session)."""
import pytest

from tests.slurm.jobs import REFERENCE_STEPS, cluster_problem, job_log, job_state, submit, wait_gone


def pytest_configure(config):
    config.addinivalue_line("markers", "slurm: runs jobs on the local Slurm cluster (scripts/slurm_cluster.sh up); "
                                       "skipped when it is not up")


@pytest.fixture(scope="session")
def cluster():
    problem = cluster_problem()
    if problem:
        pytest.skip(problem)


@pytest.fixture(scope="session")
def reference(cluster, tiny_shards, tmp_path_factory):
    """The uninterrupted run of REFERENCE_STEPS steps, submitted through `python -m slurm submit`: (job id, its
    out_dir, the states squeue showed)."""
    root = tmp_path_factory.mktemp("reference")
    job = submit(tiny_shards, root, "reference", REFERENCE_STEPS)
    seen: set[str] = set()
    wait_gone(job, 300, seen)
    out = root / "reference"
    state = job_state(job)
    print(f"job {job}: squeue showed {sorted(seen)}, scontrol JobState={state['JobState']} "
          f"ExitCode={state['ExitCode']}")
    assert state["JobState"] == "COMPLETED", job_log(out, job)
    return job, out, seen
