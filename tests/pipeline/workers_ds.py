"""Worker of the DeepSpeed test: two training steps (two micro-batches each, per-sequence depths) of the parcae case
with AdamW under DeepSpeed ZeRO 1/2/3 (and stage 2 with CPU offload); saves the parameters from rank 0. Under
ZeRO 1/2 the ranks run different numbers of loop steps; ZeRO-3 needs equal ones (see pipeline.deepspeed_engine),
checked both ways."""
from __future__ import annotations

import torch

from megaloop.optim import build_optimizer
from pipeline.deepspeed_engine import DeepSpeedRuntime
from pipeline.layout import init_layout
from tests.pipeline.models import case_config, dims, make_model, optim_config
from tests.pipeline.workers_dp import MICRO, ROWS_PER_RANK, union_batch

STEPS = 2
SETTINGS = [(1, False), (2, False), (2, True), (3, False)]  # (ZeRO stage, CPU offload)


def micro_batches(cfg, step: int, dp: int, dp_rank: int, equal_loops: bool):
    """This rank's micro-batches of step `step`: (ids, labels, depth, sample index, loss weight)."""
    ids, labels, depth = union_batch(cfg, dp, seed=step, equal_rank_max=equal_loops)
    global_tokens = float((labels != -100).sum())
    index = torch.arange(ids.shape[0])
    for start in range(dp_rank * ROWS_PER_RANK, (dp_rank + 1) * ROWS_PER_RANK, MICRO):
        sl = slice(start, start + MICRO)
        yield ids[sl], labels[sl], depth[sl], index[sl], int((labels[sl] != -100).sum()) / global_tokens


def run_step(lm, cfg, step, dp, dp_rank, backward, equal_loops: bool) -> None:
    for ids, labels, depth, index, weight in micro_batches(cfg, step, dp, dp_rank, equal_loops):
        out = lm(ids, labels, depth=depth, backprop_depth=cfg.backprop_depth, noise_key=(0, step, index))
        backward(out.loss * weight)


def run_setting(cfg, stage: int, offload: bool) -> dict:
    layout = init_layout(tp=1, model=dims(cfg))
    runtime = DeepSpeedRuntime(layout, stage, micro_batch=MICRO, micro_batches_per_step=ROWS_PER_RANK // MICRO,
                               offload=offload)
    model = make_model("parcae")
    lm = runtime.prepare_model(model)
    opt = runtime.prepare_optimizer(build_optimizer(model.named_parameters(), optim_config(name="adamw"), STEPS))
    norms = []
    for step in range(STEPS):
        run_step(lm, cfg, step, layout.dp, layout.dp_rank, runtime.backward, equal_loops=stage == 3)
        runtime.reduce_gradients(lm)
        norms.append(opt.step(step).grad_norm)
        opt.zero_grad()
    if stage == 3:
        from deepspeed.utils import safe_get_full_fp32_param
        params = {n: safe_get_full_fp32_param(p).detach().clone() for n, p in model.named_parameters()}
    else:
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"params": params, "norms": norms, "optimizer": type(runtime.proxy.engine.optimizer).__name__}


def unequal_loops_under_zero3(cfg) -> str:
    """ZeRO-3 with ranks running different loop counts: the error message (instead of a collective mismatch)."""
    layout = init_layout(tp=1, model=dims(cfg))
    runtime = DeepSpeedRuntime(layout, 3, micro_batch=MICRO, micro_batches_per_step=ROWS_PER_RANK // MICRO)
    model = make_model("parcae")
    lm = runtime.prepare_model(model)
    runtime.prepare_optimizer(build_optimizer(model.named_parameters(), optim_config(name="adamw"), STEPS))
    try:
        run_step(lm, cfg, 0, layout.dp, layout.dp_rank, runtime.backward, equal_loops=False)
    except RuntimeError as err:
        return str(err)
    return ""


def worker(rank: int, world: int, out_path: str) -> None:
    cfg = case_config("parcae")
    results = {setting: run_setting(cfg, *setting) for setting in SETTINGS}
    results["zero3_unequal"] = unequal_loops_under_zero3(cfg)
    if rank == 0:
        torch.save(results, out_path)
