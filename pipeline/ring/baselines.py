"""The classic schedules in the ring's terms, for comparison: GPipe, 1F1B and Megatron's interleaved 1F1B.

A classic pipeline of p stages is a ring whose micro-batches make one lap with autograd (laps = grad_laps = 1);
interleaved 1F1B with v model chunks per rank is a ring with laps = grad_laps = v (chunk c of rank r is lap c's
segment r). Each function returns per-rank action lists (Sends and Recvs included) that `simulate` runs like any
ring schedule, so the simulator reproduces the known makespans: (m + p - 1)(f + b) for GPipe and 1F1B,
(m v + p - 1)(f + b) for interleaved 1F1B with per-chunk costs f, b (m a multiple of p, no latency).
"""
from __future__ import annotations

from pipeline.ring.actions import (
    Action,
    Backward,
    Compute,
    Embed,
    EmbedBackward,
    Forward,
    Loss,
    LossBackward,
    MicroBatch,
    ScheduleError,
)
from pipeline.ring.p2p import with_p2p


def uniform_specs(m: int, v: int = 1) -> list[MicroBatch]:
    """m micro-batches of v laps, all with autograd (a classic pipeline when v = 1)."""
    return [MicroBatch(v, v) for _ in range(m)]


def _forward_unit(mb: int, chunk: int, rank: int, pp: int, v: int) -> list[Compute]:
    unit: list[Compute] = [Embed(mb)] if rank == 0 and chunk == 0 else []
    unit.append(Forward(mb, chunk, rank, True))
    return unit + ([Loss(mb)] if rank == pp - 1 and chunk == v - 1 else [])


def _backward_unit(mb: int, chunk: int, rank: int, pp: int, v: int) -> list[Compute]:
    unit: list[Compute] = [LossBackward(mb)] if rank == pp - 1 and chunk == v - 1 else []
    unit.append(Backward(mb, chunk, rank))
    return unit + ([EmbedBackward(mb)] if rank == 0 and chunk == 0 else [])


def gpipe(pp: int, m: int) -> list[list[Action]]:
    """Every micro-batch's forward, then every backward (in micro-batch order)."""
    orders = [[a for mb in range(m) for a in _forward_unit(mb, 0, r, pp, 1)]
              + [a for mb in range(m) for a in _backward_unit(mb, 0, r, pp, 1)] for r in range(pp)]
    return with_p2p(orders, uniform_specs(m))


def one_f_one_b(pp: int, m: int) -> list[list[Action]]:
    """PipeDream-flush 1F1B: rank r runs min(p - r - 1, m) forwards, then alternates forward and backward."""
    return _one_f_one_b(pp, m, 1, [(mb, 0) for mb in range(m)], [(mb, 0) for mb in range(m)],
                        lambda r: min(pp - r - 1, m))


def interleaved_1f1b(pp: int, m: int, v: int) -> list[list[Action]]:
    """Megatron's interleaved 1F1B with v chunks per rank (m must be a multiple of pp)."""
    if m % pp:
        raise ScheduleError(f"interleaved 1F1B needs the micro-batch count ({m}) to be a multiple of pp ({pp})")

    def unit(k: int, backward: bool) -> tuple[int, int]:
        group, within = divmod(k, pp * v)
        chunk = within // pp
        return group * pp + within % pp, (v - 1 - chunk if backward else chunk)

    total = m * v
    forwards = [unit(k, False) for k in range(total)]
    backwards = [unit(k, True) for k in range(total)]
    warmup = (lambda r: total) if m == pp else (lambda r: min((pp - r - 1) * 2 + (v - 1) * pp, total))
    return _one_f_one_b(pp, m, v, forwards, backwards, warmup)


def _one_f_one_b(pp, m, v, forwards, backwards, warmup) -> list[list[Action]]:
    orders = []
    for r in range(pp):
        w = warmup(r)
        sequence = [("F", u) for u in forwards[:w]]
        for i in range(len(forwards) - w):
            sequence += [("F", forwards[w + i]), ("B", backwards[i])]
        sequence += [("B", u) for u in backwards[len(forwards) - w:]]
        make = {"F": _forward_unit, "B": _backward_unit}
        orders.append([a for kind, (mb, chunk) in sequence for a in make[kind](mb, chunk, r, pp, v)])
    return with_p2p(orders, uniform_specs(m, v))
