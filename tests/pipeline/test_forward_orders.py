"""The forward-only orders of pipeline validation (pipeline.pipeline_runtime.forward_orders): every Embed, Forward
and Loss of the micro-batches exactly once, on its own rank, each after its input, and, with the point-to-point
actions added, runnable to the end: a replay in which a Recv waits until its message has been sent (Sends never
block) finishes on every rank; the same replay finds the deadlock of orders that break the global order."""
from __future__ import annotations

import pytest

from pipeline.pipeline_runtime import forward_orders
from pipeline.ring import Embed, Forward, Loss, MicroBatch, Recv, Send, chain, rank_of, with_p2p


def replay(actions: list[list]) -> bool:
    """True when every rank's list runs to its end (Sends post at once, a Recv needs its message posted)."""
    sent, position = set(), [0] * len(actions)
    progress = True
    while progress:
        progress = False
        for rank, mine in enumerate(actions):
            while position[rank] < len(mine):
                action = mine[position[rank]]
                if isinstance(action, Recv) and action.message not in sent:
                    break
                if isinstance(action, Send):
                    sent.add(action.message)
                position[rank] += 1
                progress = True
    return all(p == len(a) for p, a in zip(position, actions))


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_forward_orders_cover_each_action_once_and_never_deadlock(pp):
    specs = [MicroBatch(3, 1), MicroBatch(5, 1), MicroBatch(1, 1), MicroBatch(4, 1)][:pp + 1]
    orders = forward_orders(specs, pp)
    expected = {a for mb, spec in enumerate(specs) for a in chain(mb, spec, pp) if isinstance(a, (Embed, Forward, Loss))}
    flat = [a for order in orders for a in order]
    assert len(flat) == len(set(flat)) and set(flat) == expected
    assert all(rank_of(a, pp) == rank for rank, order in enumerate(orders) for a in order)
    assert replay(with_p2p(orders, specs))


def test_replay_detects_a_deadlock():
    """Rank 0 taking micro-batch 1's second lap before micro-batch 0's first, while rank 1 keeps the global order,
    waits for a message rank 1 sends only after one it cannot compute yet."""
    specs = [MicroBatch(2, 1), MicroBatch(2, 1)]
    orders = forward_orders(specs, 2)
    rank0 = [a for a in orders[0] if not isinstance(a, Forward)] + sorted(
        (a for a in orders[0] if isinstance(a, Forward)), key=lambda a: (-a.mb, a.lap))
    assert not replay(with_p2p([rank0, orders[1]], specs))
