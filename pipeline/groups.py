"""Creating the job's process groups at start-up with a number of world-wide operations that does not grow with it.

A job needs a group per tp, dp and pp slice, per embedding pair, and one per direction of every neighbouring pair
of pipeline stages (pipeline/ring/channels.py): 2 pp x (tp x dp) channel groups alone. How torch creates a group
decides the start-up time: every rank of the world takes part in every dist.new_group, members or not (gloo: a
barrier on the world's store; NCCL with the rank's device bound at init_process_group, as pipeline/layout.py does:
an ncclCommSplit of the world's communicator). So one group per call is one world-wide operation per group.

:func:`create_groups` takes the groups as partitions, lists of pairwise disjoint rank lists (:func:`partition`
finds them), and creates each partition with one world-wide operation:

- NCCL with a bound device: one dist.split_group per partition, each rank landing in its own part (a communicator
  of just its group);
- otherwise, for point-to-point groups (`p2p=True`: the ring channels): one dist.new_group per partition over the
  union of its groups' ranks. A rank sends to and receives from only its own pair's peer on it, so each rank still
  has one group per channel and each group one channel per rank: what the channels need (a stream, or under the
  rendezvous emulation a worker thread, per direction);
- otherwise (collective groups on gloo): one dist.new_group per group, as collectives need the exact membership.

:class:`GroupStats` counts what was created and how long it took; the run header prints it, and the planner
(megaloop/plan/startup.py) predicts the same counts from the same partitions.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Sequence

import torch.distributed as dist


@dataclass
class GroupStats:
    """What creating the groups cost this rank: world-wide operations (every rank of the world took part),
    communicators this rank holds now, groups created in all (the job's), and the seconds spent."""

    world_ops: int = 0
    communicators: int = 0
    groups: int = 0
    seconds: float = 0.0

    def add(self, other: "GroupStats") -> None:
        self.world_ops += other.world_ops
        self.communicators += other.communicators
        self.groups += other.groups
        self.seconds += other.seconds

    def as_dict(self) -> dict:
        return {"world_ops": self.world_ops, "communicators": self.communicators, "groups": self.groups,
                "seconds": self.seconds}

    def describe(self) -> str:
        return describe_groups(self.as_dict())


def describe_groups(stats: dict) -> str:
    """One line for GroupStats.as_dict() (what the run header prints)."""
    return (f"{stats['communicators']} communicators on this rank ({stats['groups']} groups in the job) in "
            f"{stats['seconds']:.2f} s, {stats['world_ops']} world-wide operations")


def partition(groups: Sequence[Sequence[int]]) -> list[list[tuple[int, ...]]]:
    """`groups` (rank lists) as partitions of pairwise disjoint ones, in order (first fit): every rank appears at
    most once in a partition. The same on every rank."""
    parts: list[list[tuple[int, ...]]] = []
    used: list[set[int]] = []
    for g in groups:
        ranks = tuple(g)
        for part, seen in zip(parts, used):
            if seen.isdisjoint(ranks):
                part.append(ranks)
                seen.update(ranks)
                break
        else:
            parts.append([ranks])
            used.append(set(ranks))
    return parts


def splits_world() -> bool:
    """Whether new groups are split from the world's communicator (NCCL with a bound device)."""
    return bool(dist.is_initialized() and getattr(dist.distributed_c10d._get_default_group(), "bound_device_id",
                                                   None))


def create_groups(partitions: Sequence[Sequence[Sequence[int]]], rank: int, timeout: timedelta | None = None,
                  p2p: bool = False, split: bool | None = None) -> tuple[dict[tuple[int, ...], object], GroupStats]:
    """(this rank's groups keyed by their rank tuple, the cost) for `partitions` (each a list of disjoint rank
    lists; see the module docstring). Collective over the world: every rank calls it with the same partitions.
    `split`: whether to split the world's communicator (default: :func:`splits_world`)."""
    split = splits_world() if split is None else split
    t0 = time.perf_counter()
    mine: dict[tuple[int, ...], object] = {}
    stats = GroupStats()
    for part in partitions:
        part = [tuple(g) for g in part]
        stats.groups += len(part)
        if split:
            made = dist.split_group(split_ranks=[list(g) for g in part], timeout=timeout)
            stats.world_ops += 1
            mine.update({g: made for g in part if rank in g})
        elif p2p:
            made = dist.new_group(sorted({r for g in part for r in g}), timeout=timeout)
            stats.world_ops += 1
            mine.update({g: made for g in part if rank in g})
        else:
            for g in part:
                made = dist.new_group(list(g), timeout=timeout)
                stats.world_ops += 1
                if rank in g:
                    mine[g] = made
    stats.communicators = len(mine)
    stats.seconds = time.perf_counter() - t0
    return mine, stats
