"""Document-aware attention (model.doc_mask) under tp2 (with and without sequence parallelism) and pp2 (the ring
schedule; the ragged loop's permuted rows and per-lap prefixes on every stage; activation checkpointing "lap"), on
2 gloo processes each: the packed rows of tests/model/doc_mask_cases.py give, for every document, the logits of
that document run alone in one process (doc_mask off), and the batch's loss and every parameter's gradient (fp64;
pp: summed over the ranks) those runs give: within 1e-12 in fp64 and 1e-6 in fp32 (max |a - b| / max(max |b|, 1))
at T = 1, T = mu_rec and mixed per-sequence depths with truncated backprop."""
from __future__ import annotations

import pytest
import torch

from tests.model.doc_mask_cases import TOL, alone, batch, grads, model_pair, rel_err, worst_grad_err
from tests.pipeline.spawn import spawn
from tests.pipeline.workers_doc_mask import CASES, DTYPES, pp_worker, tp_worker


def reference(dtype: str, case: str) -> dict:
    """Each document alone in one process (doc_mask off): logits, loss, gradients."""
    from tests.model.doc_mask_cases import DEPTH_CASES

    dt = DTYPES[dtype]
    _, plain = model_pair(dt)
    ids, labels, h0 = batch(dt, plain.cfg.d_model, plain.cfg.vocab_size)
    logits, _, loss = alone(plain, ids, labels, h0, DEPTH_CASES[case.partition("+")[0]])
    loss.backward()
    return {"logits": logits, "loss": loss.detach(), "grads": grads(plain)}


def check(label: str, dtype: str, got: dict, ref: dict) -> None:
    errs = {"logits": rel_err(got["logits"], ref["logits"]), "loss": rel_err(got["loss"], ref["loss"])}
    worst = ""
    if dtype == "fp64":
        errs["grads"], worst = worst_grad_err(got["grads"], ref["grads"])
    print(f"{label}: " + ", ".join(f"{k} {v:.1e}" for k, v in errs.items()) + (f" (worst {worst})" if worst else ""))
    assert max(errs.values()) <= TOL[DTYPES[dtype]], (label, errs)


@pytest.mark.multiproc
@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_doc_mask_under_tp2_and_pp2_equals_each_document_alone(layout, tmp_path):
    out = str(tmp_path / "results.pt")
    spawn(tp_worker if layout == "tp2" else pp_worker, 2, out)
    if layout == "tp2":
        results = torch.load(out)
    else:
        parts = [torch.load(f"{out}.{rank}") for rank in range(2)]
    for dtype, case in CASES:
        ref = reference(dtype, case)
        if layout == "tp2":
            for sp in (False, True):
                check(f"tp2 sp={sp} {dtype} {case}", dtype, results[dtype, case, sp], ref)
            continue
        first, last = (part[dtype, case] for part in parts)
        summed = {n: sum(part[dtype, case]["grads"].get(n, torch.zeros_like(g)) for part in parts)
                  for n, g in ref["grads"].items()}
        assert first["loss"] is None and not set(first["grads"]) & {n for n in last["grads"] if "core.1" in n}
        check(f"pp2 {dtype} {case}", dtype, {"logits": last["logits"], "loss": last["loss"], "grads": summed}, ref)
