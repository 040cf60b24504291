"""One reader per data-parallel replica (tp2 x dp2 on 4 gloo processes): the tensor-parallel rank 1 of each replica
reads no row, its reader reads each batch once, and every rank gets bitwise the tokens it read itself before."""
from __future__ import annotations

import pytest
import torch

from benchmarks.data_prep_loader import replica_reads_worker
from tests.pipeline.spawn import spawn

STEPS = 2


@pytest.mark.multiproc
def test_tp2_dp2_reads_each_row_once_per_replica(tiny_shards, tmp_path):
    spawn(replica_reads_worker, 4, str(tiny_shards), STEPS, str(tmp_path), ((2, 1, 2),))
    ranks = [torch.load(tmp_path / f"{rank}.pt")[2, 1, 2] for rank in range(4)]
    for got in ranks:
        tp_rank = got["coords"][0]
        assert got["equal"] and got["before"] == got["rows"] > 0
        assert got["after"] == (got["rows"] if tp_rank == 0 else 0)
    assert sum(r["after"] for r in ranks) == 16 * STEPS == sum(r["before"] for r in ranks) / 2
