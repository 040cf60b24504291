"""ParallelRuntime.prepare_model lays out no gradient buffer: the optimizer built with the runtime's parts lays out
the only one (so a build never holds two flat copies of the parameters, see benchmarks/build_memory.py), and without
an optimizer the plain buffer appears when gradients first need it: before runtime.backward, or at reduce_gradients
after backward passes that ran outside the runtime (their gradients are copied in). One process, parcae-tiny in
fp64, against the same model's gradients without any runtime (bit-identical)."""
from __future__ import annotations

import pytest
import torch

from megaloop.optim import build_optimizer
from pipeline.layout import init_layout
from pipeline.runtime import ParallelRuntime
from tests.pipeline.models import case_config, dims, make_batch, make_model, muon_functions, optim_config, plan_for

CASE = "parcae"


def runtime_and_model():
    cfg = case_config(CASE)
    runtime = ParallelRuntime(init_layout(model=dims(cfg)), plan_for(cfg), muon_functions())
    return runtime, make_model(CASE).double()


def two_losses(model):
    """Two micro-batches' losses (their backward passes accumulate into the same gradients)."""
    cfg = case_config(CASE)
    ids, labels, depth = make_batch(cfg, 4)
    index = torch.arange(4)
    return [model(ids[s], labels[s], depth=depth[s], backprop_depth=cfg.backprop_depth, noise_key=(0, 0, index[s])).loss
            for s in (slice(0, 2), slice(2, 4))]


def own_storage(p: torch.Tensor) -> bool:
    """The tensor's storage holds exactly its own elements (it is not a view into a flat buffer)."""
    return p.untyped_storage().nbytes() == p.numel() * p.element_size()


def in_flat(p: torch.Tensor, flat: torch.Tensor) -> bool:
    return p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def test_prepare_model_lays_out_nothing_and_the_optimizer_lays_out_the_only_buffer():
    runtime, model = runtime_and_model()
    before = {n: (p.data_ptr(), p.detach().clone()) for n, p in model.named_parameters()}
    runtime.prepare_model(model)
    params = dict(model.named_parameters())
    untouched = sum(own_storage(p) and p.data_ptr() == before[n][0] for n, p in params.items())
    print(f"after prepare_model: {untouched}/{len(params)} parameters in their own storage, unmoved")
    assert untouched == len(params)
    optimizer = build_optimizer(model.named_parameters(), optim_config(), 10, parts=runtime.optimizer_parts())
    groups = runtime.buffer.groups
    assert [g.late for g in groups] == [False, True]  # the blocks' parameters, then the embeddings'
    moved = sum(any(in_flat(p, g.param_flat) and in_flat(p.grad, g.grad_flat) for g in groups)
                for p in params.values())
    same = sum(torch.equal(p, before[n][1]) for n, p in params.items())
    print(f"after the optimizer: {moved}/{len(params)} parameters and gradients in its buffer, {same} values kept")
    assert runtime.buffer is optimizer.parts.buffer and runtime.reducer.buffer is optimizer.parts.buffer
    assert moved == same == len(params)


@pytest.mark.parametrize("how", ["runtime.backward", "backward, then reduce_gradients"])
def test_the_plain_buffer_appears_when_gradients_need_it(how):
    reference = make_model(CASE).double()
    for loss in two_losses(reference):
        loss.backward()
    runtime, model = runtime_and_model()
    runtime.prepare_model(model)
    for loss in two_losses(model):
        if how == "runtime.backward":
            runtime.backward(loss)
        else:
            loss.backward()
    runtime.reduce_gradients(model)
    groups = runtime.buffer.groups
    ref = dict(reference.named_parameters())
    params = dict(model.named_parameters())
    equal = sum(torch.equal(p.grad, ref[n].grad) for n, p in params.items())
    flat = sum(any(in_flat(p, g.param_flat) and in_flat(p.grad, g.grad_flat) for g in groups)
               for p in params.values())
    print(f"{how}: {equal}/{len(params)} gradients bit-identical to the model's without a runtime, {flat} in the "
          "plain buffer")
    assert equal == flat == len(params) and all(g.dp == 1 for g in groups)
