"""Validation loss (and bits per byte when the data knows its bytes per token) at fixed loop depths.

Evaluation always fixes T for every sequence (never a sampled depth) and seeds h_0 from (seed, step=-1,
validation row), so a validation number is comparable across steps and runs.
"""
from __future__ import annotations

import functools
import math

import torch

from megaloop.model.stages import StageMicroBatch
from megaloop.train.labels import next_token_labels
from megaloop.train.precision import autocast_for
from megaloop.train.protocols import TrainerRuntime

VAL_NOISE_STEP = -1


def default_val_depths(mu_rec: int, looped: bool) -> list[int]:
    if not looped:
        return [1]
    return sorted({1, 2, 4, mu_rec, 2 * mu_rec})


def final_val_depths(cfg, periodic: list[int]) -> list[int]:
    """The end-of-run evaluation covers every T in 1..2 mu_rec (the summary table), plus the periodic depths."""
    if not cfg.model.is_looped:
        return periodic
    return sorted(set(periodic) | set(range(1, 2 * cfg.model.mu_rec + 1)))


@torch.no_grad()
def validation_losses(model, batches: list[dict], depths: list[int], seed: int, precision: str, device,
                      runtime: TrainerRuntime, bytes_per_token: float | None = None, progress=None
                      ) -> dict[int, dict]:
    """{T: {"val_loss", "val_bpb", "tokens"}} over the given validation batches (token-weighted, summed over dp).

    val_loss and val_bpb are NaN when there is no validation token. progress: the Progress whose terminal shows a
    transient bar for this pass (default: the open training bar of this process, if any).
    """
    from megaloop.train.progress import active

    progress = progress if progress is not None else active()
    bar = progress.validation(depths, len(batches)) if progress is not None and batches else None
    try:
        return _losses(model, batches, depths, seed, precision, device, runtime, bytes_per_token, bar)
    finally:
        if bar is not None:
            bar.close()


def _losses(model, batches, depths, seed, precision, device, runtime: TrainerRuntime, bytes_per_token, bar
            ) -> dict[int, dict]:
    was_training = model.training
    model.eval()
    results = {}
    autocast = functools.partial(autocast_for, precision, device)
    for depth in depths:
        if bar is not None:
            bar.depth(depth)
        micro_batches = [_micro_batch(batch, depth, seed, device) for batch in batches]
        counts = [int((mb.labels != -100).sum()) for mb in micro_batches]
        # every batch is run, padding-only ones too (their loss is left out): the ranks of a job run the same
        # forwards, which engines that gather parameters in the forward (ZeRO-3) and pipeline rings require
        losses = runtime.forward_losses(model, micro_batches, autocast)  # the runtime's forward (a ring under pp)
        if bar is not None:
            bar.update(len(batches))
        loss_sum = sum(loss * n for loss, n in zip(losses, counts) if n)
        loss_sum, tokens = runtime.sum_over_dp(loss_sum), int(runtime.sum_over_dp(float(sum(counts))))
        rows = int(runtime.sum_over_dp(float(sum(_rows(batch) for batch in batches))))
        # no validation tokens (no val split, or data.val_batches=0): no measurement, so NaN ("n/a"), never 0
        loss = loss_sum / tokens if tokens else float("nan")
        bpb = loss / math.log(2) / bytes_per_token if bytes_per_token and tokens else float("nan")
        results[depth] = {"val_loss": loss, "val_bpb": bpb, "tokens": tokens, "rows": rows}
    model.train(was_training)
    return results


def _rows(batch: dict) -> int:
    """The batch's validation rows (its padding rows not counted)."""
    valid = batch.get("valid")
    return int(valid.sum()) if valid is not None else int(batch["tokens"].shape[0])


def _micro_batch(batch: dict, depth: int, seed: int, device) -> StageMicroBatch:
    """A validation batch at fixed depth T: inputs, next-token labels (-100 on the padding rows of the last
    batch, and where the target is the shards' pad token: batch["pad_id"]) and h_0's noise key (seed,
    VAL_NOISE_STEP, row)."""
    tokens = batch["tokens"].to(device)
    labels = next_token_labels(tokens, batch.get("pad_id")).clone()
    valid = batch.get("valid")
    if valid is not None:
        labels[~valid.to(device)] = -100
    return StageMicroBatch(tokens[:, :-1], labels, depth,
                           noise_key=(seed, VAL_NOISE_STEP, batch["sample_index"].clamp(min=0)))
