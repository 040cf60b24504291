"""Advice followed, at the layout checks that run before any process group: each size, device or backend a
refusal proposes is passed back, and the check then passes."""
from __future__ import annotations

import ast
import re

import pytest
import torch

from pipeline.layout import BatchDims, LayoutError, ModelDims, choose_backend, choose_device, validate_layout


def listed(message: str, before: str) -> list[int]:
    """The integers of the [..] list that follows `before` in a message."""
    found = re.search(re.escape(before) + r"\[([\d, ]+)\]", message)
    assert found, message
    return [int(v) for v in found.group(1).split(", ")]


def test_a_world_size_tp_does_not_divide_passes_with_each_tp_listed():
    with pytest.raises(LayoutError) as refused:
        validate_layout(6, tp=4)
    for tp in listed(str(refused.value), "valid tp for pp=1: "):
        assert validate_layout(6, tp=tp)[0] == tp
    pairs = re.search(r"\(tp, pp\) pairs that work: (\[[\d, ()]+\])", str(refused.value)).group(1)
    for tp, pp in ast.literal_eval(pairs):
        assert validate_layout(6, tp=tp, pp=pp)[:2] == (tp, pp)


@pytest.mark.parametrize("model", [ModelDims(6, 6, 4096), ModelDims(8, 2, 4096), ModelDims(8, 8, 4098)])
def test_a_tp_the_model_cannot_split_passes_with_each_tp_listed(model):
    with pytest.raises(LayoutError) as refused:
        validate_layout(4, tp=4, model=model)
    for tp in listed(str(refused.value), "tp values that work with this model and world size: "):
        assert validate_layout(4, tp=tp, model=model)[0] == tp


def test_sequence_parallelism_over_a_tp_that_does_not_divide_seq_len_passes_either_way():
    model = ModelDims(4, 4, 4096, seq_len=66)
    with pytest.raises(LayoutError) as refused:
        validate_layout(4, tp=4, model=model)
    message = str(refused.value)
    for tp in listed(message, "use one of tp "):
        assert validate_layout(4, tp=tp, model=model)[0] == tp
    assert "set parallel.sequence_parallel=false" in message
    assert validate_layout(4, tp=4, model=model, sequence_parallel=False)[0] == 4


def test_a_dp_that_does_not_fit_the_world_passes_unset_or_set_to_the_value_named():
    with pytest.raises(LayoutError) as refused:
        validate_layout(8, tp=2, dp=3)
    dp = int(re.search(r"leave dp unset \(it becomes (\d+)\) or set it to that", str(refused.value)).group(1))
    assert validate_layout(8, tp=2) == validate_layout(8, tp=2, dp=dp) == (2, 1, 4)


def test_a_batch_that_does_not_split_over_dp_passes_with_the_batch_or_the_job_named():
    with pytest.raises(LayoutError) as refused:
        validate_layout(8, batch=BatchDims(global_batch=16, micro_batch=4))
    message = str(refused.value)
    batch = int(re.search(r"for this job set data\.global_batch_size=(\d+)", message).group(1))
    assert validate_layout(8, batch=BatchDims(batch, 4))[2] == 8
    for dp in listed(message, "dp values that work: "):  # each on a job of tp x pp x dp processes
        assert validate_layout(dp, batch=BatchDims(16, 4))[2] == dp


def test_a_device_or_backend_this_machine_lacks_passes_with_each_one_proposed():
    if torch.cuda.is_available():
        pytest.skip("the refusals are for a machine without CUDA")
    with pytest.raises(LayoutError) as refused:
        choose_device(0, "cuda")
    for device in re.search(r"use (\w+) or (\w+)$", str(refused.value)).groups():
        assert choose_device(0, device).type == "cpu"
    with pytest.raises(LayoutError) as refused:
        choose_backend(torch.device("cpu"), "nccl")
    for backend in re.search(r"on CPU use (\w+) or (\w+)$", str(refused.value)).groups():
        assert choose_backend(torch.device("cpu"), backend) == "gloo"
