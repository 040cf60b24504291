"""Process groups at start-up (pipeline/groups.py): partitions of disjoint groups, one world-wide operation per
partition (a communicator split on NCCL, emulated here by a recording stand-in for dist.split_group; on gloo one
group per partition of channels), the counts a real gloo job reports against the planner's formula
(megaloop/plan/startup.py), and messages that still reach their peer on every channel of every pipeline."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megaloop.plan.startup import startup_groups
from pipeline import groups as groups_module
from pipeline.groups import create_groups, partition
from pipeline.layout import group_ranks, init_layout
from pipeline.ring.channels import ring_channels, ring_pairs
from tests.pipeline.spawn import spawn


def _channels(tp: int, dp: int, pp: int) -> list[tuple[int, int]]:
    return [(r[s], r[d]) for r in group_ranks(tp, dp, pp)["pp"] for s, d in ring_pairs(pp)]


@pytest.mark.parametrize("tp,dp,pp", [(1, 16, 8), (2, 4, 5), (1, 3, 2), (1, 1, 3)])
def test_channels_fall_into_a_few_partitions_of_disjoint_pairs(tp, dp, pp):
    channels = _channels(tp, dp, pp)
    parts = partition(channels)
    print(f"tp {tp} dp {dp} pp {pp}: {len(channels)} channels in {len(parts)} partitions")
    assert sorted(g for part in parts for g in part) == sorted(channels)  # each channel once, direction kept
    for part in parts:
        members = [r for g in part for r in g]
        assert len(members) == len(set(members))  # a rank at most once per partition
    assert len(parts) <= 6  # independent of dp and tp: three directions at most x two parities


def test_nccl_splits_once_per_partition(monkeypatch):
    """With a bound device every group is split from the world's communicator: one dist.split_group per
    partition, and each rank gets the group of its own part."""
    calls = []

    def split_group(split_ranks, timeout=None):
        calls.append(split_ranks)
        return f"split{len(calls)}"

    monkeypatch.setattr(groups_module.dist, "split_group", split_group)
    monkeypatch.setattr(groups_module.dist, "new_group", lambda *a, **k: pytest.fail("new_group on the split path"))
    channels = _channels(1, 16, 8)
    parts = partition(channels)
    mine, stats = create_groups(parts, rank=19, p2p=True, split=True)
    assert calls == [[list(g) for g in part] for part in parts]
    assert stats.world_ops == len(parts) and stats.groups == len(channels) == 256
    assert sorted(mine) == sorted(g for g in channels if 19 in g) and len(mine) == 4
    assert all(mine[g] == f"split{k + 1}" for k, part in enumerate(parts) for g in part if 19 in g)
    formula = startup_groups(1, 16, 8, "nccl")
    assert formula.world_ops == 3 + len(parts) and formula.world_ops_before == 16 + 8 + 16 + 256


def _job(rank: int, world: int, pp: int, out: str) -> None:
    layout = init_layout(pp=pp, dp=world // pp)
    channels = ring_channels(group_ranks(1, layout.dp, pp)["pp"], rank)
    # every rank sends its rank to its successor and predecessor on their channels, and receives theirs
    position, ranks = channels.position, channels.ranks
    got = {}
    for step in (1, -1):
        dst, src = (position + step) % pp, (position - step) % pp
        if dst == position:
            continue
        recv = torch.zeros(1)
        sent = dist.isend(torch.tensor([float(rank)]), ranks[dst], group=channels.group(position, dst))
        dist.irecv(recv, ranks[src], group=channels.group(src, position)).wait()
        sent.wait()
        got[step] = int(recv.item())
    stats = [layout.group_stats, channels.stats]
    torch.save({"got": got, "ranks": ranks, "position": position,
                "stats": [(s.world_ops, s.communicators, s.groups) for s in stats]}, f"{out}.{rank}")
    channels.close()


@pytest.mark.multiproc
@pytest.mark.parametrize("pp", [2, 4])
def test_a_gloo_job_reports_what_the_planner_predicts(pp, tmp_path):
    out = str(tmp_path / "job")
    spawn(_job, 4, pp, out)
    formula = startup_groups(1, 4 // pp, pp, "gloo")
    most = 0
    for rank in range(4):
        r = torch.load(f"{out}.{rank}")
        (kind_ops, kind_comms, kind_groups), (chan_ops, chan_comms, chan_groups) = r["stats"]
        print(f"pp {pp} rank {rank}: {kind_comms + chan_comms} communicators, {kind_ops + chan_ops} world-wide "
              f"operations ({formula.world_ops} predicted, {formula.world_ops_before} one per group)")
        assert kind_ops + chan_ops == formula.world_ops < formula.world_ops_before
        assert kind_groups + chan_groups == formula.groups
        most = max(most, kind_comms + chan_comms)
        ranks, position = r["ranks"], r["position"]
        for step, sender in r["got"].items():
            assert sender == ranks[(position - step) % pp]  # each message came from the right neighbour
    assert most == formula.communicators  # the formula's: a first or last stage's rank (the embed group's)
