"""The local Slurm cluster for tests/slurm: the `slurm` marker and a fixture that skips, with the reason, when the
cluster cannot take jobs."""
import pytest

from tests.slurm.jobs import cluster_problem


def pytest_configure(config):
    config.addinivalue_line("markers", "slurm: runs jobs on the local Slurm cluster (scripts/slurm_cluster.sh up); "
                                       "skipped when it is not up")


@pytest.fixture(scope="session")
def cluster():
    problem = cluster_problem()
    if problem:
        pytest.skip(problem)
