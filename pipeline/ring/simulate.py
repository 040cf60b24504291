"""Runs per-rank action lists against a cost model: makespan, busy and idle time per rank, peak stored activations,
and every way a schedule can be wrong (an action on the wrong rank, twice or missing, an input used before it
exists, a Recv that does not match its channel's next Send, a deadlock with its cycle of waiting ranks).

Semantics (those of the executor): each rank runs its list in order; a compute action starts when the previous
action of its rank has finished and lasts its cost; a Send is asynchronous and takes no time, its message arrives
the cost model's `delay` later (with `rendezvous`: after the later of the Send and the posting of its Recv, which
the executor posts with the whole run of Sends and Recvs, when the compute action before it ends); a Recv waits for
the next message of its channel (src -> this rank), which must be the one it names.

`p2p` chooses the point-to-point semantics: "async" (above: gloo's, a Send is free); "rendezvous" (NCCL's, as the
executor posts it: one group per direction of a channel, pipeline.ring.channels): a message moves only once its Recv
is posted and the channel's previous message has arrived (a Send holds its channel's stream until its Recv takes
it), and nothing waits on a Send; "shared" (NCCL's semantics under the earlier posting: one group per pipeline, each
run of Sends and Recvs one batch that its rank waits for whole): a rank stays at a batch until every Send in it met
its Recv and every Recv its Send, each in the peer's current batch, so ranks whose batches send to each other before
receiving wait forever (DeadlockError; a message is matched by name there, not by channel order). Stored activations: Embed, a
Forward with autograd and Loss each store one unit on their rank until their backward frees it. A micro-batch is "in
flight" on a rank while it has lap (or loss) activations stored there, and "open" from its Embed to its
EmbedBackward (rank 0 keeps its e and prelude activations meanwhile; its no-autograd laps store nothing else).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from pipeline.ring.actions import (
    Action,
    Backward,
    Compute,
    Embed,
    EmbedBackward,
    Forward,
    Loss,
    LossBackward,
    Message,
    MicroBatch,
    Recv,
    ScheduleError,
    Send,
    chain,
    is_compute,
    label,
    rank_of,
)
from pipeline.ring.costs import CostModel
from pipeline.ring.p2p import neighbours


P2P_SEMANTICS = ("async", "rendezvous", "shared")


class DeadlockError(ScheduleError):
    """Ranks wait on each other: `cycle` lists (rank, the Recv it is blocked at, or under p2p "shared" the Send or
    Recv) around the cycle of waits, or, when the wait ends at a rank that finished without sending, along that chain
    of waits."""

    def __init__(self, message: str, cycle: list[tuple[int, Action]]):
        super().__init__(message)
        self.cycle = cycle


@dataclass
class SimResult:
    """What a simulated schedule did. peak_in_flight[r]: most micro-batches with stored lap (or loss) activations on
    rank r at once; peak_stored[r]: most stored units on rank r; peak_open: most micro-batches between their Embed
    and EmbedBackward (their e and prelude activations stay on rank 0); intervals: (rank, start, end, compute
    action) in execution order."""

    makespan: float
    busy: list[float]
    peak_in_flight: list[int]
    peak_stored: list[int]
    peak_open: int
    intervals: list[tuple[int, float, float, Compute]] = field(repr=False)

    @property
    def idle_fractions(self) -> list[float]:
        """Per rank, the fraction of the makespan it spent not computing."""
        return [1.0 - b / self.makespan if self.makespan else 0.0 for b in self.busy]

    @property
    def idle_fraction(self) -> float:
        """Idle rank-time over all rank-time: 1 - sum(busy) / (pp * makespan)."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan) if self.makespan else 0.0

    @property
    def bubble_ratio(self) -> float:
        """Idle rank-time over busy rank-time (Megatron's 'bubble time fraction' convention)."""
        return len(self.busy) * self.makespan / sum(self.busy) - 1.0 if sum(self.busy) else 0.0


class _Simulation:
    def __init__(self, schedule, specs, costs, p2p="async"):
        if p2p not in P2P_SEMANTICS:
            raise ValueError(f"p2p must be one of {', '.join(P2P_SEMANTICS)}, got {p2p!r}")
        self.schedule, self.specs, self.costs, self.p2p = schedule, list(specs), costs, p2p
        self.free: dict[tuple[int, int], float] = {}  # rendezvous: when each channel's last message arrived
        self.matched: dict[Message, float] = {}  # shared: messages whose Send met its Recv, and when they arrive
        self.pp = len(schedule)
        self.before, self.after = neighbours(self.specs, self.pp)
        self.pos = [0] * self.pp
        self.clock = [0.0] * self.pp
        self.posted = [0.0] * self.pp  # when each rank posted its current run of Sends and Recvs
        self.busy = [0.0] * self.pp
        self.done: list[set] = [set() for _ in range(self.pp)]
        self.received: list[set] = [set() for _ in range(self.pp)]
        self.sent: dict[tuple[int, int], list[tuple[Message, float]]] = {}
        self.taken: dict[tuple[int, int], int] = {}
        self.stored: list[dict[int, int]] = [{} for _ in range(self.pp)]
        self.units = [0] * self.pp
        self.peak_in_flight = [0] * self.pp
        self.peak_stored = [0] * self.pp
        self.open: set[int] = set()
        self.peak_open = 0
        self.intervals: list[tuple[int, float, float, Compute]] = []

    def run(self) -> SimResult:
        while True:
            progressed = False
            for rank in range(self.pp):
                while self.pos[rank] < len(self.schedule[rank]) and self._step(rank):
                    self.pos[rank] += 1
                    progressed = True
            if all(p == len(s) for p, s in zip(self.pos, self.schedule)):
                break
            if not progressed:
                self._raise_deadlock()
        self._check_complete()
        return SimResult(max(self.clock, default=0.0), self.busy, self.peak_in_flight, self.peak_stored,
                         self.peak_open, self.intervals)

    def _step(self, rank: int) -> bool:
        action = self.schedule[rank][self.pos[rank]]
        if self.p2p == "shared" and isinstance(action, (Send, Recv)):
            return self._batch(rank)
        if isinstance(action, Recv):
            return self._recv(rank, action)
        if isinstance(action, Send):
            self._send(rank, action)
        elif is_compute(action):
            self._compute(rank, action)
        else:
            raise ScheduleError(f"rank {rank}, position {self.pos[rank]}: {action!r} is not a ring-schedule action")
        return True

    def _recv(self, rank: int, action: Recv) -> bool:
        channel = (action.src, rank)
        index = self.taken.get(channel, 0)
        posted = self.sent.get(channel, [])
        if index >= len(posted):
            return False
        message, time = posted[index]
        if message != action.message:
            raise ScheduleError(f"rank {rank} receives {label(action)} but the next message from rank {action.src} "
                                f"is {label(message.producer)}: Recvs must follow the channel's Send order")
        self.taken[channel] = index + 1
        self.received[rank].add(message)
        if self.costs.rendezvous or self.p2p == "rendezvous":
            time = max(time, self.posted[rank])
        if self.p2p == "rendezvous":  # the channel's stream: after its previous message arrived
            time = max(time, self.free.get(channel, 0.0))
        arrival = time + self.costs.delay(message, self.specs)
        self.free[channel] = arrival
        self.clock[rank] = max(self.clock[rank], arrival)
        return True

    def _run_of(self, rank: int) -> list[Action]:
        """The run of Sends and Recvs at this rank's position (one batch under p2p "shared")."""
        actions, end = self.schedule[rank], self.pos[rank]
        while end < len(actions) and isinstance(actions[end], (Send, Recv)):
            end += 1
        return actions[self.pos[rank]:end]

    def _batch(self, rank: int) -> bool:
        """p2p "shared": match what this rank's batch can match now; move past it when all of it is matched."""
        batch = self._run_of(rank)
        for action in batch:
            peer = action.dst if isinstance(action, Send) else action.src
            if action.message in self.matched or self.pos[peer] >= len(self.schedule[peer]):
                continue
            counterpart = Recv(rank, action.message) if isinstance(action, Send) else Send(rank, action.message)
            if counterpart in self._run_of(peer):
                self.matched[action.message] = max(self.posted[rank], self.posted[peer]) + self.costs.delay(
                    action.message, self.specs)
        if any(action.message not in self.matched for action in batch):
            return False
        for action in batch:
            if isinstance(action, Send):
                self._send(rank, action)
            else:
                self.received[rank].add(action.message)
            self.clock[rank] = max(self.clock[rank], self.matched[action.message])
        self.pos[rank] += len(batch) - 1
        return True

    def _send(self, rank: int, action: Send) -> None:
        producer = action.message.producer
        if producer not in self.done[rank]:
            raise ScheduleError(f"rank {rank} sends {label(action)} before computing {label(producer)} on it")
        successor = self.after.get(producer)
        if successor is None or rank_of(successor, self.pp) != action.dst:
            raise ScheduleError(f"rank {rank} sends {label(action)}, but nothing on rank {action.dst} consumes it")
        self.sent.setdefault((rank, action.dst), []).append((action.message, self.clock[rank]))

    def _compute(self, rank: int, action: Compute) -> None:
        self._check_runnable(rank, action)
        duration = self.costs.of(action, self.specs)
        start = self.clock[rank]
        self.clock[rank] = self.posted[rank] = start + duration
        self.busy[rank] += duration
        self.done[rank].add(action)
        self.intervals.append((rank, start, start + duration, action))
        self._account_memory(rank, action)

    def _check_runnable(self, rank: int, action: Compute) -> None:
        if not 0 <= action.mb < len(self.specs):
            raise ScheduleError(f"rank {rank}: {label(action)} names micro-batch {action.mb}, but there are "
                                f"{len(self.specs)}")
        if action not in self.before and action not in self.after:
            raise ScheduleError(f"rank {rank}: {action} is not part of micro-batch {action.mb}'s chain "
                                f"(lap, stage or autograd flag out of range for {self.specs[action.mb]})")
        if rank_of(action, self.pp) != rank:
            raise ScheduleError(f"{label(action)} is on rank {rank} but belongs on rank {rank_of(action, self.pp)}")
        if action in self.done[rank]:
            raise ScheduleError(f"rank {rank} runs {label(action)} twice")
        producer = self.before.get(action)
        if producer is None:
            return
        if rank_of(producer, self.pp) == rank:
            ready = producer in self.done[rank]
        else:
            ready = Message(producer) in self.received[rank]
        if not ready:
            raise ScheduleError(f"rank {rank} runs {label(action)} before it has the output of {label(producer)}")

    def _account_memory(self, rank: int, action: Compute) -> None:
        if isinstance(action, (Embed, Loss)) or (isinstance(action, Forward) and action.grad):
            self.units[rank] += 1
        elif is_compute(action) and not isinstance(action, Forward):
            self.units[rank] -= 1
        self.peak_stored[rank] = max(self.peak_stored[rank], self.units[rank])
        if isinstance(action, Embed):
            self.open.add(action.mb)
            self.peak_open = max(self.peak_open, len(self.open))
        elif isinstance(action, EmbedBackward):
            self.open.discard(action.mb)
        counts = self.stored[rank]
        if isinstance(action, Loss) or (isinstance(action, Forward) and action.grad):
            counts[action.mb] = counts.get(action.mb, 0) + 1
        elif isinstance(action, (Backward, LossBackward)):
            counts[action.mb] -= 1
            if counts[action.mb] == 0:
                del counts[action.mb]
        self.peak_in_flight[rank] = max(self.peak_in_flight[rank], len(counts))

    def _raise_deadlock(self) -> None:
        waits = {}
        for rank in range(self.pp):
            if self.pos[rank] < len(self.schedule[rank]):
                waits[rank] = self.schedule[rank][self.pos[rank]]
        if self.p2p == "shared":  # a rank waits at the first action of its batch still unmatched
            waits = {r: next(a for a in self._run_of(r) if a.message not in self.matched) for r in waits}
        rank, path = next(iter(waits)), []
        while rank in waits and rank not in [r for r, _ in path]:
            path.append((rank, waits[rank]))
            rank = _peer(waits[rank])
        steps = "; ".join(f"rank {r} waits at {label(a)} for rank {_peer(a)}" for r, a in path)
        if rank not in waits:
            raise DeadlockError(f"rank {rank} finished without sending what rank {path[-1][0]} waits for: {steps}",
                                path)
        cycle = path[[r for r, _ in path].index(rank):]
        steps = "; ".join(f"rank {r} waits at {label(a)} for rank {_peer(a)}" for r, a in cycle)
        raise DeadlockError(f"deadlock: {steps}", cycle)

    def _check_complete(self) -> None:
        missing = [label(a) for mb, spec in enumerate(self.specs) for a in chain(mb, spec, self.pp)
                   if a not in self.done[rank_of(a, self.pp)]]
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise ScheduleError(f"the schedule never runs {shown}")


def _peer(action: Action) -> int:
    return action.dst if isinstance(action, Send) else action.src


def simulate(schedule: Sequence[Sequence[Action]], specs: Sequence[MicroBatch],
             costs: CostModel = CostModel(), max_in_flight: int | None = None,
             max_open: int | None = None, p2p: str = "async") -> SimResult:
    """Simulates `schedule` (one action list per ring rank) for the micro-batches `specs` under the point-to-point
    semantics `p2p` ("async", "rendezvous" or "shared", see the module docstring).

    Raises ScheduleError for an invalid schedule, DeadlockError (with the cycle) for one that hangs, and
    ScheduleError when some rank holds more than `max_in_flight` micro-batches' lap activations at once or more than
    `max_open` micro-batches are open at once.
    """
    result = _Simulation(schedule, specs, costs, p2p).run()
    if max_open is not None and result.peak_open > max_open:
        raise ScheduleError(f"{result.peak_open} micro-batches are open at once, above the bound {max_open}")
    if max_in_flight is not None and max(result.peak_in_flight) > max_in_flight:
        raise ScheduleError(f"peak micro-batches in flight per rank {result.peak_in_flight} exceed the bound "
                            f"{max_in_flight}")
    return result
