"""Next-token labels of packed rows, with the pad positions left out of the loss.

A row of seq_len + 1 tokens gives inputs row[:-1] and labels row[1:]. Rows packed best fit (data_prep.packing) end
in pad tokens when a split's documents run out before the row is full, and a --keep-last-partial row does too; a
label whose target is the pad id becomes -100, which every loss of the model ignores (cross_entropy's
ignore_index), so padding never counts as text to predict, and the loss over a padded row is the loss over its
real tokens. The pad id is the shards' (manifest tokenizer.pad_id); None leaves every label as it is.

The step weighs each micro-batch's mean token loss by its rows x seq_len (megaloop/train/step.py), so in a step that
holds a padded row (at most one per split and work unit) that row's real tokens weigh slightly more than the others,
and layouts that group the rows into different micro-batches differ in that step by this weighting; steps without
padding are unaffected.
"""
from __future__ import annotations

import torch

IGNORE_INDEX = -100


def next_token_labels(rows: torch.Tensor, pad_id: int | None) -> torch.Tensor:
    """rows[:, 1:] with IGNORE_INDEX where the target token is `pad_id` (a new tensor when any is; a view of `rows`
    otherwise, as before)."""
    labels = rows[:, 1:]
    if pad_id is None:
        return labels
    return labels.masked_fill(labels == pad_id, IGNORE_INDEX)
