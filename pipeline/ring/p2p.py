"""Adds the point-to-point actions to per-rank orders of compute actions.

A Send goes right after the compute action whose output the next action of its chain needs on another rank. Recvs
are placed in each channel's (src -> dst) send order, which is what NCCL-style point-to-point (matched in order,
without tags) requires: a rank that needs a message which was sent after others on the same channel receives those
others first and keeps them until they are used. Sends are asynchronous (the executor posts `isend` and keeps the
tensor alive until it completes); only a Recv waits.

Actions are located in their chains once (micro-batch, position); neighbours and ranks are then read by index
(`add_p2p`, which the generator calls with the positions its plan recorded).
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

from pipeline.ring.actions import Action, Compute, Message, MicroBatch, Recv, ScheduleError, Send, chain, rank_of

Position = tuple[int, int]  # (micro-batch, index in its chain)


def neighbours(specs: Sequence[MicroBatch], pp: int) -> tuple[dict, dict]:
    """(predecessor, successor) of every compute action of the micro-batches `specs` along its chain."""
    before, after = {}, {}
    for mb, spec in enumerate(specs):
        actions = chain(mb, spec, pp)
        for first, second in zip(actions, actions[1:]):
            after[first], before[second] = second, first
    return before, after


def with_p2p(orders: Sequence[Sequence[Compute]], specs: Sequence[MicroBatch]) -> list[list[Action]]:
    """Per-rank action lists: the compute `orders` (one list per ring rank) with their Sends and Recvs."""
    pp = len(orders)
    chains = [chain(mb, spec, pp) for mb, spec in enumerate(specs)]
    position = {action: (mb, i) for mb, actions in enumerate(chains) for i, action in enumerate(actions)}
    positions = [[position.get(action) for action in order] for order in orders]
    ranks = [[rank_of(a, pp) for a in actions] for actions in chains]
    return add_p2p(orders, positions, chains, ranks)


def add_p2p(orders: Sequence[Sequence[Compute]], positions: Sequence[Sequence[Position | None]],
            chains: Sequence[Sequence[Compute]], ranks: Sequence[Sequence[int]]) -> list[list[Action]]:
    """As `with_p2p`, given each ordered action's (micro-batch, chain index) in `positions` (None: in no chain,
    so without neighbours), the micro-batches' `chains` and each chain action's rank."""
    channels: dict[tuple[int, int], deque] = {}
    with_sends: list[list[tuple[Action, Position | None]]] = []
    for rank, (order, where) in enumerate(zip(orders, positions)):
        actions: list[tuple[Action, Position | None]] = []
        for action, at in zip(order, where):
            actions.append((action, at))
            if at is None or at[1] + 1 == len(chains[at[0]]):
                continue
            dst = ranks[at[0]][at[1] + 1]
            if dst != rank:
                message = Message(action)
                actions.append((Send(dst, message), None))
                channels.setdefault((rank, dst), deque()).append((at, message))
        with_sends.append(actions)
    return [_add_recvs(rank, actions, chains, ranks, channels) for rank, actions in enumerate(with_sends)]


def _add_recvs(rank: int, actions: list[tuple[Action, Position | None]], chains, ranks,
               channels: dict) -> list[Action]:
    received: set[Position] = set()
    out: list[Action] = []
    for action, at in actions:
        if at is not None and at[1] > 0 and ranks[at[0]][at[1] - 1] != rank:
            needed = (at[0], at[1] - 1)
            if needed not in received:
                src = ranks[at[0]][at[1] - 1]
                queue = channels.get((src, rank), deque())
                while needed not in received:
                    if not queue:
                        producer = chains[at[0]][at[1] - 1]
                        raise ScheduleError(f"rank {rank} needs the output of {producer} from rank {src}, which "
                                            f"never sends it: put {producer} in rank {src}'s order")
                    sent, message = queue.popleft()
                    out.append(Recv(src, message))
                    received.add(sent)
        out.append(action)
    return out
