"""What creating a layout's process groups costs at start-up, from the partitions the runtime creates them with.

pipeline/layout.py creates each kind of group (tp, dp, pp, embed) as one partition and pipeline/ring/channels.py the
ring channels of every pipeline as the partitions pipeline.groups.partition finds; pipeline.groups.create_groups
spends one world-wide operation per partition on NCCL (a communicator split), and on gloo one per partition of
channels and one per tp/dp/pp/embed group. The counts here come from the same functions, so they are what the run
header prints ("process groups: ...") for the same layout. `before` is the earlier code's: one world-wide operation
per group of every kind, channels included.
"""
from __future__ import annotations

from dataclasses import dataclass

from pipeline.groups import partition
from pipeline.layout import group_ranks
from pipeline.ring.channels import ring_pairs


@dataclass(frozen=True)
class StartupGroups:
    """World-wide operations to create every group (now, and with one per group as before), groups in the job,
    and the communicators the busiest rank holds (a first or last stage's: it is in the embed group too)."""

    world_ops: int
    world_ops_before: int
    groups: int
    communicators: int


def startup_groups(tp: int, dp: int, pp: int, backend: str = "nccl") -> StartupGroups:
    """The start-up cost of a tp x dp x pp layout on `backend` ("nccl": device bound, groups split; "gloo")."""
    kinds = group_ranks(tp, dp, pp)
    sizes = {"tp": tp, "dp": dp, "pp": pp, "embed": min(pp, 2)}
    made = [kinds[k] for k, size in sizes.items() if size > 1]
    channels = [(ranks[s], ranks[d]) for ranks in kinds["pp"] for s, d in ring_pairs(len(ranks))] if pp > 1 else []
    parts = partition(channels)
    kind_ops = len(made) if backend == "nccl" else sum(len(groups) for groups in made)
    groups = sum(len(groups) for groups in made) + len(channels)
    mine = len(made) + (0 if pp == 1 else len(ring_pairs(pp)) if pp == 2 else 4)
    return StartupGroups(kind_ops + len(parts), groups, groups, mine)


def startup_line(tp: int, dp: int, pp: int, backend: str = "nccl") -> str:
    s = startup_groups(tp, dp, pp, backend)
    return (f"process groups ({backend}): {s.groups} in the job, {s.communicators} communicators per rank, "
            f"{s.world_ops} world-wide operations to create them (one per group: {s.world_ops_before})")
