"""Process-group timeouts per phase and communicator warm-up: init_layout gives every group (the world's too) the
start-up timeout and runs one all-reduce per group before returning; set_group_timeouts switches them all to the
step timeout (what the trainer does once the steps begin, and back around a save)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.pipeline.spawn import spawn


def _timeouts(layout) -> list[float]:
    from pipeline.layout import layout_groups

    return [g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in layout_groups(layout)]


def timeouts_worker(rank: int, world: int, out_path: str) -> None:
    from pipeline import layout as layout_module

    calls = []
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(kwargs.get("group"))
        return real(tensor, *args, **kwargs)

    layout_module.dist.all_reduce = counting
    try:
        layout = layout_module.init_layout(pp=2, timeout_s=5.0, startup_timeout_s=50.0)
    finally:
        layout_module.dist.all_reduce = real
    groups = layout_module.layout_groups(layout)
    report = {"groups": len(groups), "warm_ups": len(calls), "distinct": len({id(g) for g in calls}),
              "startup": _timeouts(layout)}
    layout_module.set_group_timeouts(layout, 5.0)
    report["steps"] = _timeouts(layout)
    torch.save(report, f"{out_path}.{rank}")


@pytest.mark.multiproc
def test_groups_start_with_the_startup_timeout_are_warmed_up_and_switch_to_the_step_timeout(tmp_path):
    spawn(timeouts_worker, 2, str(tmp_path / "t"))
    for rank in range(2):
        r = torch.load(f"{tmp_path / 't'}.{rank}")
        print(f"rank {rank}: {r}")
        assert r["groups"] == 3  # world, pp, embed (pp 2 on 2 ranks)
        assert r["warm_ups"] == r["distinct"] == 3  # one all-reduce per group
        assert r["startup"] == [50.0] * 3 and r["steps"] == [5.0] * 3
