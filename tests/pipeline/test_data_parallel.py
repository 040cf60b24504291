"""Data-parallel gradients, with per-rank different loop depths and gradient accumulation, equal the
single-process gradients over the union batch (fp32, 1e-5 relative per tensor); with the reduction after the
backward and with buckets overlapping the last backward."""
from __future__ import annotations

import pytest
import torch

from tests.pipeline.models import case_config, grads_of, make_model, max_rel_err
from tests.pipeline.spawn import spawn
from tests.pipeline.workers_dp import union_batch, worker

TOL = 1e-5


def union_reference(case: str, dp: int):
    cfg = case_config(case)
    model = make_model(case)
    ids, labels, depth = union_batch(cfg, dp)
    out = model(ids, labels, depth=depth, backprop_depth=cfg.backprop_depth,
                noise_key=(0, 0, torch.arange(ids.shape[0])))
    out.loss.backward()
    return grads_of(model)


@pytest.mark.multiproc
@pytest.mark.parametrize("overlap", [False, True])
def test_dp_gradients_equal_union_batch(overlap, tmp_path):
    out = tmp_path / "dp.pt"
    spawn(worker, 2, "parcae", 1, overlap, str(out))
    got = torch.load(out)
    ref = union_reference("parcae", 2)
    worst = max((max_rel_err(got["grads"][n], g), n) for n, g in ref.items())
    print(f"dp=2 overlap={overlap}: depths {got['depths']}, {got['buckets']} buckets ({got['overlapped']} launched "
          f"during the backward), worst grad err {worst[0]:.2e} ({worst[1]})")
    assert got["buckets"] > 3
    assert (got["overlapped"] > 0) == overlap
    assert worst[0] <= TOL
