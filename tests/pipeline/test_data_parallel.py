"""Data-parallel gradients, with per-rank different loop depths and gradient accumulation, equal the
single-process gradients over the union batch (fp32, 1e-5 relative per tensor); with the reduction after the
backward and with buckets overlapping the last backward."""
from __future__ import annotations

import pytest
import torch

from tests.pipeline.models import case_config, grads_of, make_model, max_rel_err
from tests.pipeline.spawn import spawn
from pipeline.data_parallel import BufferReducer, default_bucket_elements
from pipeline.grad_buffer import GradBuffer
from tests.pipeline.workers_dp import overlap_worker, union_batch, worker

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
          f"during the backward; {got['early']:.1%} of the bytes before its last gradient, {got['not_lookups']:.1%} "
          f"outside the embeddings' groups), worst grad err {worst[0]:.2e} ({worst[1]})")
    assert got["buckets"] > 3
    assert (got["overlapped"] > 0) == overlap
    # the buffer in backward order: every bucket outside the embeddings' groups goes before backward ends
    assert got["early"] >= got["not_lookups"] if overlap else got["early"] == 0
    assert worst[0] <= TOL


@pytest.mark.multiproc
def test_overlapped_param_gather_equals_synchronous(tmp_path):
    """dp2 ZeRO-1 steps: the all-gather left in flight under the next forward (the values other ranks own set to
    NaN until gathered, so a module reading a parameter before its wait fails) gives bitwise the losses and
    parameters of the gather finished inside the optimizer step."""
    out = tmp_path / "overlap.pt"
    spawn(overlap_worker, 2, str(out))
    got = torch.load(out)
    on, off = got[True], got[False]
    print(f"{on['ranges']} gather buckets; pending at each forward: {on['pending_at_forward']}")
    assert on["losses"] == off["losses"]
    assert on["ranges"] > 3 and on["pending_at_forward"] == [False, True]
    assert not any(off["pending_at_forward"])
    assert all(torch.equal(on["params"][n], p) for n, p in off["params"].items())


def test_reduce_refuses_grad_outside_the_buffer():
    """A .grad replaced by a fresh tensor (or None) is no longer reduced with the buffer: reduce() names it."""
    assert default_bucket_elements(4) == 40_000_000 and default_bucket_elements(128) == 128_000_000
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    reducer = BufferReducer(GradBuffer(list(model.named_parameters())), None)
    reducer.reduce()  # every .grad is the buffer's view
    model[1].weight.grad = torch.zeros_like(model[1].weight)
    with pytest.raises(RuntimeError, match=r"'1\.weight'.*outside the gradient buffer"):
        reducer.reduce()
    model[1].weight.grad = None
    with pytest.raises(RuntimeError, match="is None"):
        reducer.reduce()
