"""The process groups the ring executor's messages travel on: one per direction of each channel.

A channel is an ordered pair of ring ranks (src -> dst). Each rank sends to its two ring neighbours (a lap's state
forward, a gradient backward) and receives from them, and every direction gets a two-rank group that carries only
that direction's messages, in the channel's Send order. Under NCCL a group is a communicator with its own stream;
on gloo with `rendezvous` semantics `RendezvousP2P` gives each group the same (pipeline.ring.rendezvous).

Why a group per direction rather than pairing each Send with the Recv that follows it in one batch (Megatron's
send_forward_recv_backward): Megatron's 1F1B alternates its sends and receives in lock step, so every rank's paired
batches meet their peers' paired batches. The ring schedule is list-scheduled, so a rank's next Recv may come from
the other neighbour, after other compute, or be several messages later on the channel, and a paired batch would tie
this rank's compute stream (Work.wait() under NCCL makes it wait on the whole batch, the send included) to the peer
posting its receive, which the peer does only after compute of its own that may wait on this rank: whether that
closes a cycle depends on each schedule. With one group per direction no compute ever waits on a Send:

- a rank's compute stream waits only on its Recvs' Works; a Send's Work is waited for only at the end of the run,
  when every Recv of the step has been posted;
- a Send's stream waits on the compute that made the message (NCCL orders it after the compute stream at posting)
  and on the channel's earlier Sends; a Recv's stream on the compute before it and the channel's earlier Recvs;
- so a Send only delays later messages of its own channel, which the receiver takes in that order after this one.

Every wait then points to an event that the generator's timed plan (or any run with asynchronous sends) puts no
later, so a schedule that runs with asynchronous sends runs under rendezvous: no cycle can pass through a compute
stream. The cost is two communicators per neighbour pair instead of one per pipeline (each holds its own buffers).
One group per ring direction (every rank's "forward" messages on one communicator) would not do: a rank's send to
its successor and its receive from its predecessor would share a stream, and with every rank's stream stuck on its
send the ring would hang.

Creating them: the channels of every pipeline are partitioned into sets of disjoint pairs (at most three
directions x two parities) and each set is created with one world-wide operation (pipeline.groups: one NCCL
communicator split, or on gloo one group over the set's ranks, on which each rank talks to its pair's peer only),
not one per channel: 2 pp x (tp x dp) channels cost a constant number of world-wide operations.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch.distributed as dist

from pipeline.groups import GroupStats, create_groups, partition
from pipeline.ring.rendezvous import EAGER_BYTES, RendezvousP2P

SEMANTICS = ("auto", "rendezvous")


def ring_pairs(pp: int) -> list[tuple[int, int]]:
    """The channels (src, dst) of a ring of pp ranks: each rank to its successor and to its predecessor."""
    return sorted({(r, d) for r in range(pp) for d in ((r + 1) % pp, (r - 1) % pp) if d != r})


@dataclass
class RingChannels:
    """This rank's side of its pipeline's channels: `ranks` the pipeline's global ranks in ring order, `position`
    this rank's place in it, `groups[(src, dst)]` the group of each of this rank's channels (ring positions),
    `post` what posts a batch (dist.batch_isend_irecv, or its rendezvous emulation on gloo)."""

    ranks: tuple[int, ...]
    position: int
    groups: dict[tuple[int, int], dist.ProcessGroup] = field(default_factory=dict)
    post: Callable[[Sequence[dist.P2POp]], list] = dist.batch_isend_irecv
    stats: GroupStats = field(default_factory=GroupStats)  # what creating every pipeline's channels cost

    def group(self, src: int, dst: int) -> dist.ProcessGroup:
        """The group of channel src -> dst (ring positions)."""
        group = self.groups.get((src, dst))
        if group is None:
            raise ValueError(f"ring positions {src} -> {dst} are not ring neighbours: messages travel only between "
                             f"neighbours ({', '.join(f'{s}->{d}' for s, d in sorted(self.groups))})")
        return group

    def close(self) -> None:
        """Ends the rendezvous emulation's threads (if any) and drops the groups."""
        if isinstance(self.post, RendezvousP2P):
            self.post.close()
        self.groups = {}


def emulates(semantics: str, backend: str) -> bool:
    """Whether `semantics` on `backend` needs the rendezvous emulation: only rendezvous on gloo (NCCL has it)."""
    if semantics not in SEMANTICS:
        raise ValueError(f"p2p semantics must be one of {', '.join(SEMANTICS)}, got {semantics!r}")
    return semantics == "rendezvous" and backend == "gloo"


def ring_channels(pp_groups: Sequence[Sequence[int]], rank: int, semantics: str = "auto",
                  eager_bytes: int = EAGER_BYTES, timeout_s: float = 600.0) -> Optional[RingChannels]:
    """The channels of `rank`'s pipeline, None if `rank` is in none of `pp_groups` (each a pipeline's global ranks in
    ring order). Collective over the world: every rank calls it with every pipeline, in the same order (it
    creates the channel groups, see the module docstring); the channels hold only this rank's own. `timeout_s`:
    how long an operation may wait (the groups' timeout and the emulation's)."""
    emulate = emulates(semantics, dist.get_backend())
    channels = [(ranks[s], ranks[d]) for ranks in pp_groups for s, d in ring_pairs(len(ranks))]
    made, stats = create_groups(partition(channels), rank, datetime.timedelta(seconds=timeout_s), p2p=True)
    mine = None
    for ranks in pp_groups:
        if rank in ranks:
            groups = {(s, d): made[(ranks[s], ranks[d])] for s, d in ring_pairs(len(ranks))
                      if rank in (ranks[s], ranks[d])}
            mine = RingChannels(tuple(ranks), list(ranks).index(rank), groups, stats=stats)
    if mine is not None and emulate:
        mine.post = RendezvousP2P(eager_bytes, timeout_s)
    return mine
