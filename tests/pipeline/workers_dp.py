"""Worker of the data-parallel test: each dp rank runs its rows of a union batch, in two micro-batches, with its
own per-sequence depths (so ranks reuse the core weights a different number of times), then the bucketed reducer
sums the gradients. Rank 0 saves the reduced gradients."""
from __future__ import annotations

import torch

from pipeline.layout import init_layout
from pipeline.runtime import ParallelRuntime
from tests.pipeline.models import case_config, dims, grads_of, make_model, plan_for

ROWS_PER_RANK = 4
MICRO = 2


def union_batch(cfg, dp: int, seed: int = 0, equal_rank_max: bool = False):
    """ids, labels and depths of the union batch; rank r gets rows [r*4, (r+1)*4). Rank 0's sequences are short
    (depth 1-2), the last rank's long (depth 6-7); equal_rank_max: the last row of every micro-batch gets depth 7,
    so every rank runs the same number of loop steps (sequences still differ)."""
    g = torch.Generator().manual_seed(7 + seed)
    rows = ROWS_PER_RANK * dp
    ids = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (rows, cfg.seq_len), generator=g)
    labels[1, :5] = -100
    depth = torch.cat([torch.randint(1 + 5 * (r == dp - 1), 3 + 5 * (r == dp - 1), (ROWS_PER_RANK,), generator=g)
                       for r in range(dp)])
    if equal_rank_max:
        depth[MICRO - 1::MICRO] = 7
    return ids, labels, depth


def local_step(lm, cfg, ids, labels, depth, index, global_tokens, before_last_backward=None):
    """Two micro-batches, each loss scaled by its share of the global (valid) tokens, as the trainer does."""
    for start in range(0, ids.shape[0], MICRO):
        sl = slice(start, start + MICRO)
        out = lm(ids[sl], labels[sl], depth=depth[sl], backprop_depth=cfg.backprop_depth,
                 noise_key=(0, 0, index[sl]))
        n_valid = int((labels[sl] != -100).sum())
        if before_last_backward is not None and start + MICRO >= ids.shape[0]:
            before_last_backward()
        (out.loss * (n_valid / global_tokens)).backward()


def worker(rank: int, world: int, case: str, tp: int, overlap: bool, out_path: str) -> None:
    cfg = case_config(case)
    layout = init_layout(tp=tp, model=dims(cfg))
    runtime = ParallelRuntime(layout, plan_for(cfg), bucket_elements=8192)  # tiny buckets: many of them
    model = make_model(case)
    lm = runtime.prepare_model(model)
    ids, labels, depth = union_batch(cfg, layout.dp)
    mine = slice(layout.dp_rank * ROWS_PER_RANK, (layout.dp_rank + 1) * ROWS_PER_RANK)
    local_valid = float((labels[mine] != -100).sum())
    global_tokens = runtime.sum_over_dp(local_valid)
    index = torch.arange(ids.shape[0])
    local_step(lm, cfg, ids[mine], labels[mine], depth[mine], index[mine], global_tokens,
               runtime.overlap_next_backward if overlap else None)
    runtime.reduce_gradients(lm)
    from pipeline.tensor_parallel import gather_full
    grads = {n: gather_full(g, runtime.tp_info.shards.get(n), layout.tp_group) for n, g in grads_of(model).items()}
    if rank == 0:
        lookups = sum(g.grad_flat.numel() for g in runtime.buffer.groups if g.late)
        torch.save({"grads": grads, "buckets": len(runtime.reducer.buckets),
                    "overlapped": runtime.reducer.launched_in_backward,
                    "early": runtime.reducer.last_overlap.early_fraction,
                    "not_lookups": 1 - lookups / runtime.buffer.numel(), "depths": depth.tolist()}, out_path)


def overlap_worker(rank: int, world: int, out_path: str, steps: int = 2) -> None:
    """ZeRO-1 training steps with the parameter all-gather overlapped (the stale chunks poisoned with NaN, so a read
    before its wait shows) and not, in the same processes: losses, parameters and what the overlap did."""
    from megaloop.optim import build_optimizer
    from tests.pipeline.models import make_batch, muon_functions, optim_config

    cfg = case_config("parcae")
    out = {}
    for overlap in (True, False):
        layout = init_layout(tp=1, model=dims(cfg))
        runtime = ParallelRuntime(layout, plan_for(cfg), muon_functions(), bucket_elements=65536,
                                  overlap_param_gather=overlap)
        model = runtime.prepare_model(make_model("parcae"))
        opt = build_optimizer(model.named_parameters(), optim_config(), steps, parts=runtime.optimizer_parts())
        gather = opt.parts.gather
        gather.poison = overlap
        losses, pending_at_forward = [], []
        for step in range(steps):
            ids, labels, depth = make_batch(cfg, 2, seed=10 * step + layout.dp_rank)
            pending_at_forward.append(gather.pending)
            loss = model(ids, labels, depth=depth, noise_key=(0, step, torch.arange(2))).loss
            losses.append(loss.item())
            runtime.backward(loss)
            runtime.reduce_gradients(model)
            opt.step(step)
            opt.zero_grad()
        runtime.finish_param_gather()
        out[overlap] = {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
                        "pending_at_forward": pending_at_forward, "ranges": len(gather.ranges)}
    if rank == 0:
        torch.save(out, out_path)
