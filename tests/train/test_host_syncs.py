"""The training step reads nothing back from the device inside its micro-batch loop, and talks to the other ranks
once per step for its statistics.

A TorchDispatchMode, active around every step's micro-batch loop (forwards and backwards included), counts the ops
that make the host wait for a value: aten._local_scalar_dense (.item(), float(), bool() of a tensor) and the
data-dependent shapes aten.nonzero / masked_select. On the CPU these are as visible as on a GPU. Expected: zero, on
one process and under dp2 with depth balancing (micro-batches of different sizes on the two ranks).

The collectives of a dp2 step (from the start of train_step to the end of its statistics reduction) are counted by
wrapping torch.distributed's functions and attributed by the caller: exactly one is the packed statistics reduction
(runtime.sum_stats); every other one is issued from train_step's backward, gradient reduction or optimizer calls
(whatever the gradient reducer and the distributed optimizer need).
"""
from __future__ import annotations

import functools
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import megaloop.train.loop as loop
from megaloop.config import load_config
from megaloop.train.loop import train
from tests.pipeline.spawn import spawn
from tests.train.conftest import TINY, fast_overrides

SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "item"}
# the lines of megaloop/train/step.py (and of the micro-batch loop it hands to the runtime) from which gradient and
# optimizer traffic may start
STEP_FILES = ("megaloop/train/step.py", "pipeline/micro_batches.py")
GRADIENT_CALLS = ("runtime.backward(", "runtime.reduce_gradients(", "optimizer.step(", "optimizer.zero_grad(")
COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "reduce_scatter_tensor", "reduce_scatter", "reduce_scatter_single",
               "all_gather_into_tensor", "all_gather", "all_gather_single", "all_gather_coalesced", "all_gather_object",
               "broadcast", "broadcast_object_list", "barrier", "monitored_barrier", "reduce", "send", "recv", "isend",
               "irecv", "batch_isend_irecv", "all_to_all", "all_to_all_single", "scatter", "gather", "gather_object",
               "scatter_object_list", "_all_gather_base", "_reduce_scatter_base", "_broadcast_coalesced")
STEPS = 3


class SyncCounter(TorchDispatchMode):
    """Counts ops that wait for the device's result on the host."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNC_OPS:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def overrides(shards, out_dir, dp: int) -> list[str]:
    """Per-sequence depths, micro-batches of 2 out of 8 rows: several micro-batches of different depths."""
    return fast_overrides(shards, out_dir, steps=STEPS) + [
        "data.micro_batch_size=2", "data.val_batches=0", "train.val_every=1000", f"parallel.dp={dp}",
        "train.precision=fp64"]


def _origin(name: str, stack) -> str:
    """"stats" (runtime.sum_stats), "gradient" (a gradient or optimizer call of train_step) or "other: ..."."""
    if any(frame.name == "sum_stats" for frame in stack):
        return "stats"
    step_lines = [frame.line or "" for frame in stack if frame.filename.endswith(STEP_FILES)]
    if step_lines and any(call in step_lines[-1] for call in GRADIENT_CALLS):
        return "gradient"
    return f"other: {name}\n" + "".join(traceback.format_list(stack))


def traced_train(cfg, runtime=None) -> dict:
    """Run the trainer with the loop guard counting host syncs and the collectives of each step attributed."""
    counter = SyncCounter()
    calls, active = [], {"on": False}
    real_step, real_reduce = loop.train_step, loop.reduce_step

    def train_step(*args, **kwargs):
        active["on"] = True
        calls.append("step")
        return real_step(*args, loop_guard=lambda: counter, **kwargs)

    def reduce_step(*args, **kwargs):
        try:
            return real_reduce(*args, **kwargs)
        finally:
            active["on"] = False

    def wrap(name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            outermost = active["on"] and not active.get("inside")
            if outermost:  # a collective that torch implements with another one counts once
                calls.append(_origin(name, traceback.extract_stack()))
                active["inside"] = True
            try:
                return fn(*args, **kwargs)
            finally:
                if outermost:
                    active["inside"] = False
        return wrapper

    dist = torch.distributed
    saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    loop.train_step, loop.reduce_step = train_step, reduce_step
    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        summary = train(cfg, runtime)
    finally:
        loop.train_step, loop.reduce_step = real_step, real_reduce
        for name, fn in saved.items():
            setattr(dist, name, fn)
    per_step, current = [], None
    for c in calls:
        if c == "step":
            current = {"stats": 0, "gradient": 0, "other": []}
            per_step.append(current)
        elif c.startswith("other"):
            current["other"].append(c)
        else:
            current[c] += 1
    return {"syncs": list(counter.seen), "per_step": per_step, "steps": calls.count("step"), "losses": summary.losses}


def test_no_host_sync_in_the_micro_batch_loop_single_process(tiny_shards, tmp_path):
    got = traced_train(load_config(TINY, overrides(tiny_shards, tmp_path, 1)))
    print(f"one process, {got['steps']} steps: host syncs in the micro-batch loops: {len(got['syncs'])}")
    assert got["steps"] == STEPS and len(got["losses"]) == STEPS
    assert got["syncs"] == []


def test_counter_sees_a_host_sync(tiny_shards, tmp_path):
    """The counter is not blind: a float() of the loss inside the loop is seen."""
    counter = SyncCounter()
    with counter:
        loss = torch.ones(3, dtype=torch.float64).sum()
        float(loss)
        torch.nonzero(torch.ones(2))
    assert counter.seen == ["_local_scalar_dense", "nonzero"]


def _dp2_worker(rank: int, world: int, shards: str, out_dir: str, result: str) -> None:
    got = traced_train(load_config(TINY, overrides(shards, f"{out_dir}/dp2", 2)))
    torch.save(got, f"{result}.{rank}")


@pytest.mark.multiproc
def test_no_host_sync_and_one_stats_reduction_per_step_dp2(tiny_shards, tmp_path):
    spawn(_dp2_worker, 2, str(tiny_shards), str(tmp_path), str(tmp_path / "result"))
    for rank in range(2):
        got = torch.load(tmp_path / f"result.{rank}")
        print(f"dp2 rank {rank}: host syncs in the micro-batch loops: {len(got['syncs'])}; collectives per step: "
              + ", ".join(f"{s['stats']} statistics + {s['gradient']} gradient/optimizer" for s in got["per_step"]))
        assert got["syncs"] == []
        assert len(got["per_step"]) == STEPS
        for step in got["per_step"]:
            assert step["other"] == [], step["other"][0]
            assert step["stats"] == 1 and step["gradient"] >= 1
