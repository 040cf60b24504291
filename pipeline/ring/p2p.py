"""Adds the point-to-point actions to per-rank orders of compute actions.

A Send goes right after the compute action whose output the next action of its chain needs on another rank. Recvs
are placed in each channel's (src -> dst) send order, which is what NCCL-style point-to-point (matched in order,
without tags) requires: a rank that needs a message which was sent after others on the same channel receives those
others first and keeps them until they are used. Sends are asynchronous (the executor posts `isend` and keeps the
tensor alive until it completes); only a Recv waits.
"""
from __future__ import annotations

from collections import deque
from typing import Sequence

from pipeline.ring.actions import Action, Compute, Message, MicroBatch, Recv, ScheduleError, Send, chain, rank_of


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
    before, after = neighbours(specs, pp)
    channels: dict[tuple[int, int], deque] = {}
    with_sends: list[list[Action]] = []
    for rank, order in enumerate(orders):
        actions: list[Action] = []
        for action in order:
            actions.append(action)
            successor = after.get(action)
            if successor is not None and rank_of(successor, pp) != rank:
                dst = rank_of(successor, pp)
                actions.append(Send(dst, Message(action)))
                channels.setdefault((rank, dst), deque()).append(Message(action))
        with_sends.append(actions)
    return [_add_recvs(rank, actions, before, channels, pp) for rank, actions in enumerate(with_sends)]


def _add_recvs(rank: int, actions: list[Action], before: dict, channels: dict, pp: int) -> list[Action]:
    received: set[Message] = set()
    out: list[Action] = []
    for action in actions:
        producer = before.get(action)
        if producer is not None and rank_of(producer, pp) != rank and Message(producer) not in received:
            src = rank_of(producer, pp)
            queue = channels.get((src, rank), deque())
            while Message(producer) not in received:
                if not queue:
                    raise ScheduleError(f"rank {rank} needs the output of {producer} from rank {src}, which never "
                                        f"sends it: put {producer} in rank {src}'s order")
                message = queue.popleft()
                out.append(Recv(src, message))
                received.add(message)
        out.append(action)
    return out
