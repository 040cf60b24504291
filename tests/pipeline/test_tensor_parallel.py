"""Tensor-parallel forward + backward of parcae-tiny-sized models equals one process (fp32) for tp 2 and
4, with and without sequence parallelism; logits, loss and every parameter's gradient within 1e-5 relative (fp32
itself is ~3e-6 away from a float64 run of these models). Vocab-parallel cross-entropy equals the full one."""
from __future__ import annotations

import pytest
import torch

from tests.pipeline.models import CASES, case_config, grads_of, make_batch, make_model, max_rel_err
from tests.pipeline.spawn import spawn
from tests.pipeline.workers_tp import vocab_ce_logits, worker

TOL = 1e-5


def reference(case: str, batch: int = 2):
    cfg = case_config(case)
    model = make_model(case)
    ids, labels, depth = make_batch(cfg, batch)
    out = model(ids, labels, depth=depth, backprop_depth=cfg.backprop_depth if cfg.is_looped else None,
                noise_key=(0, 0, torch.arange(batch)))
    out.loss.backward()
    return {"loss": out.loss.detach(), "logits": out.logits.detach(), "grads": grads_of(model)}


def check_vocab_parallel_ce(got: dict, tp: int) -> None:
    """Vocab-parallel CE (float64 logits split over tp) equals F.cross_entropy on the full logits: loss, per-token
    losses and gradient, within 1e-12."""
    logits, labels = vocab_ce_logits()
    full = logits.clone().requires_grad_(True)
    mean = torch.nn.functional.cross_entropy(full.view(-1, full.shape[-1]), labels.view(-1), ignore_index=-100)
    mean.backward()
    per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100,
                                                  reduction="none")
    errs = [float((got["mean"] - mean.detach()).abs()), float((got["per_token"] - per_token).abs().max()),
            float((got["grad"] - full.grad).abs().max())]
    print(f"tp={tp} vocab-parallel CE: |loss - full CE| {errs[0]:.1e}, per token {errs[1]:.1e}, grad {errs[2]:.1e}")
    assert max(errs) <= 1e-12


@pytest.mark.multiproc
@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_equals_single_process(tp, tmp_path):
    cases = list(CASES)
    out = tmp_path / "tp.pt"
    spawn(worker, tp, cases, str(out))
    results = torch.load(out)
    check_vocab_parallel_ce(results["vocab_ce"], tp)
    for case in cases:
        ref = reference(case)
        for sp in (False, True):
            got = results[(case, sp)]
            worst = max((max_rel_err(got["grads"][n], g), n) for n, g in ref["grads"].items())
            print(f"tp={tp} sp={sp} {case}: loss {got['loss']:.6f} vs {ref['loss']:.6f}, "
                  f"logits err {max_rel_err(got['logits'], ref['logits']):.2e}, worst grad err {worst[0]:.2e} "
                  f"({worst[1]}), split params {len(got['shards'])}")
            assert abs(float(got["loss"] - ref["loss"])) <= TOL * abs(float(ref["loss"]))
            assert max_rel_err(got["logits"], ref["logits"]) <= TOL
            assert worst[0] <= TOL, f"{case} sp={sp}: gradient of {worst[1]} differs by {worst[0]:.2e}"
            assert got["shards"], "nothing was split"
