"""Worker of the tensor-parallel equivalence test: run forward+backward of each case under tp (with and without
sequence parallelism) and save the loss, the full (gathered) logits and the full gradients from rank 0."""
from __future__ import annotations

import torch

from pipeline.collectives import all_gather_along
from pipeline.layout import init_layout
from pipeline.parallel_lm import ParallelLM
from pipeline.tensor_parallel import gather_full, reduce_partial_grads
from tests.pipeline.models import case_config, dims, make_batch, make_model, plan_for


def tp_forward_backward(case: str, tp: int, sp: bool, batch: int = 2):
    cfg = case_config(case)
    layout = init_layout(tp=tp, model=dims(cfg), sequence_parallel=sp)
    model = make_model(case)
    lm = ParallelLM(model, layout, plan_for(cfg))
    ids, labels, depth = make_batch(cfg, batch)
    out = lm(ids, labels, depth=depth, backprop_depth=cfg.backprop_depth if cfg.is_looped else None,
             noise_key=(0, 0, torch.arange(batch)))
    out.loss.backward()
    reduce_partial_grads(model, lm.tp_info, layout.tp_group)
    grads = {n: gather_full(p.grad, lm.tp_info.shards.get(n), layout.tp_group)
             for n, p in model.named_parameters()}
    logits = all_gather_along(out.logits.detach(), -1, layout.tp_group)
    return {"loss": out.loss.detach(), "logits": logits, "grads": grads, "shards": sorted(lm.tp_info.shards)}


def vocab_ce_logits(vocab: int = 96):
    """Logits [3, 5, vocab] with a wide range (stability) and labels with ignored entries."""
    g = torch.Generator().manual_seed(3)
    logits = 30.0 * torch.randn(3, 5, vocab, generator=g, dtype=torch.float64)
    labels = torch.randint(0, vocab, (3, 5), generator=g)
    labels[0, 1] = labels[2, 4] = -100
    return logits, labels


def vocab_ce(tp: int):
    """Vocab-parallel CE (mean and per token) on this rank's slice; returns losses and the gathered gradient."""
    from pipeline.vocab_parallel import vocab_parallel_cross_entropy

    layout = init_layout(tp=tp)
    logits, labels = vocab_ce_logits()
    local = logits.chunk(tp, dim=-1)[layout.tp_rank].clone().requires_grad_(True)
    mean = vocab_parallel_cross_entropy(local, labels, layout)
    per_token = vocab_parallel_cross_entropy(local.detach(), labels, layout, reduction="none")
    mean.backward()
    return {"mean": mean.detach(), "per_token": per_token,
            "grad": all_gather_along(local.grad, -1, layout.tp_group)}


def worker(rank: int, world: int, cases: list[str], out_path: str) -> None:
    results = {"vocab_ce": vocab_ce(world)}
    for case in cases:
        for sp in (False, True):
            results[(case, sp)] = tp_forward_backward(case, world, sp)
    if rank == 0:
        torch.save(results, out_path)
