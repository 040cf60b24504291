"""One optimizer step: sample depths for the batch, bucket micro-batches, forward/backward each with the loss
weighted by its true share of tokens, reduce gradients, clip and step. Returns what happened, with timings."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from megaloop.depth import bucket_microbatches, contiguous_microbatches
from megaloop.train.flops import FlopModel
from megaloop.train.precision import autocast_for


@dataclass
class StepStats:
    loss_sum: float = 0.0  # sum over this rank's tokens of the token losses
    tokens: int = 0
    sequences: int = 0
    useful_flops: float = 0.0
    executed_flops: float = 0.0
    depth_sum: int = 0
    executed_depth_sum: int = 0
    telemetry: dict = field(default_factory=dict)
    times: dict = field(default_factory=lambda: {"forward": 0.0, "backward": 0.0, "optimizer": 0.0})
    record: object = None


def plan_microbatches(depths: torch.Tensor, micro_batch_size: int, bucket: bool) -> list:
    if bucket:
        return bucket_microbatches(depths, micro_batch_size)
    return contiguous_microbatches(len(depths), micro_batch_size)


def train_step(model, optimizer, batch: dict, depth_sample, step: int, seed: int, cfg, runtime,
               flop_model: FlopModel) -> StepStats:
    """batch: {"tokens": [rows, S+1], "sample_index": [rows]} for this data-parallel rank."""
    tokens, sample_index = batch["tokens"], batch["sample_index"]
    device = runtime.device
    stats = StepStats()
    local_tokens = tokens.shape[0] * (tokens.shape[1] - 1)
    global_tokens = runtime.sum_over_dp(float(local_tokens))
    seq = tokens.shape[1] - 1
    plan = plan_microbatches(depth_sample.T, cfg.data.micro_batch_size, cfg.train.bucket_depths)
    for i, positions in enumerate(plan):
        idx = torch.as_tensor(positions, dtype=torch.long)
        mb = tokens[idx].to(device, non_blocking=True)
        d = depth_sample.select(positions)
        t0 = time.perf_counter()
        with autocast_for(cfg.train.precision, device):
            out = model(mb[:, :-1], labels=mb[:, 1:], depth=d.T, backprop_depth=d.k,
                        noise_key=(seed, step, sample_index[idx]))
        n_tok = mb.shape[0] * seq
        scaled = out.loss * (n_tok / global_tokens)  # the global batch's token mean, whatever the split
        t1 = time.perf_counter()
        if i == len(plan) - 1:
            runtime.overlap_next_backward()  # gradients are final in this backward: reduce buckets as they are
        runtime.backward(scaled)
        stats.times["forward"] += t1 - t0
        stats.times["backward"] += time.perf_counter() - t1
        stats.loss_sum += float(out.loss.detach()) * n_tok
        stats.tokens += n_tok
        stats.sequences += mb.shape[0]
        stats.useful_flops += flop_model.useful(d.n, d.k, seq)
        stats.executed_flops += flop_model.executed(d.n, d.k, seq)
        stats.depth_sum += int(d.T.sum())
        stats.executed_depth_sum += out.telemetry.get("executed_steps", 1) * mb.shape[0]
        stats.telemetry = out.telemetry
    t2 = time.perf_counter()
    runtime.reduce_gradients(model)
    stats.record = optimizer.step(step)
    optimizer.zero_grad(set_to_none=True)
    stats.times["optimizer"] = time.perf_counter() - t2
    return stats
