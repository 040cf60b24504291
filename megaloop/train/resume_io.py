"""Cheap resume: the state that data-parallel replicas hold alike is read once per data-parallel group.

Every data-parallel rank of one (tp, pp) coordinate holds the same parameters (its tp shard of its stage's), and
under ZeRO stage 0 the same optimizer state. If every replica read them, a resume at dp ranks would read them dp
times over. :class:`DpSharedReader` instead agrees, within the data-parallel group, on the reads a load is about to
make (one object all-gather of their keys): those that every rank of the group makes ("replicated") are dealt out
byte-balanced (largest first to the least-loaded rank, as verify_share deals the verification), each rank reads its
part at once (the ranks read in parallel), and the loads then receive each array by a broadcast from the rank that
read it, in the order they ask for it. Reads that only this rank makes (its ZeRO-1 rows, the Muon matrices it owns)
are read by it, as before. The loaders (checkpointing.load_model, megaloop.optim.combined.load_sharded_state) are
unchanged: they call the reader as they always did.

The parameters' reads are known from the model. The optimizer's are learnt by a dry run of its load with
:class:`RecordingReader` (zeros of the right shape and dtype, no I/O), which the real load then repeats call for call
(the calls depend only on the layout and on which arrays the checkpoint holds); the dry run allocates the optimizer
state once more for a moment.

The broadcasts run on the group's device (layout.comm_device: the GPU under NCCL, which takes no CPU tensors; the
CPU under gloo), as raw bytes (any dtype on any backend), and what a rank receives comes back to the CPU, where a
checkpoint read returns it.
"""
from __future__ import annotations

import contextlib
import math
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from megaloop.train.checkpointing import ShardReader
from pipeline.dist_muon import assign_owners


class StateReader(Protocol):
    """What the loaders call to read checkpoint state (checkpointing.load_model, the optimizers' load_sharded_state):
    implemented by checkpointing.ShardReader, DpSharedReader and, in a dry run, RecordingReader."""

    def __call__(self, array: str, param: str, sharded: bool) -> torch.Tensor | None:
        """The whole array (sharded False) or this rank's tensor-parallel shard of it; None: no such array."""

    def rows(self, array: str, param: str, start: int, stop: int) -> torch.Tensor | None:
        """Rows [start, stop) of this rank's shard; None: no such array."""


class RecordingReader:
    """Stands in for a reader in a dry run of a load: records the keys of the reads it is asked for and returns zeros
    of the shape and dtype the real read would return (None where the checkpoint has no such array), reading
    nothing."""

    def __init__(self, reader: ShardReader):
        self.reader, self.keys = reader, []

    def __call__(self, array: str, param: str, sharded: bool):
        return self._stand_in(("read", array, param, bool(sharded)))

    def rows(self, array: str, param: str, start: int, stop: int):
        return self._stand_in(("rows", array, param, int(start), int(stop)))

    def _stand_in(self, key: tuple):
        self.keys.append(key)
        expected = self.reader.expect(key)
        return None if expected is None else torch.zeros(expected[0], dtype=expected[1])


class DpSharedReader(ShardReader):
    """A ShardReader whose reads inside replicated(keys) are shared within the data-parallel group (see the module
    docstring); every rank of the group must enter replicated() at the same point."""

    def __init__(self, reader, runtime):
        super().__init__(reader, runtime)
        layout = runtime.layout
        self.group, self.dp, self.dp_rank = layout.dp_group, layout.dp, layout.dp_rank
        self.device = layout.comm_device
        self._plan: list[tuple[tuple, int]] = []  # (key, dp rank that reads it), in the order the load asks
        self._next = 0
        self._held: dict[tuple, torch.Tensor] = {}  # what this rank read for the group, until its last use
        self._uses: Counter = Counter()  # calls of each planned key still to come

    def __call__(self, array: str, param: str, sharded: bool):
        return self._serve(("read", array, param, bool(sharded)))

    def rows(self, array: str, param: str, start: int, stop: int):
        return self._serve(("rows", array, param, int(start), int(stop)))

    def planned_reads(self, load: Callable[[StateReader], object]) -> list[tuple]:
        """The keys load(read) reads, in order, from a dry run of it with a RecordingReader."""
        recorder = RecordingReader(self)
        load(recorder)
        return recorder.keys

    @contextlib.contextmanager
    def replicated(self, keys: list[tuple]):
        """Share the reads among `keys` that every rank of the group makes, in the same order (collective over the
        group, on entering); the others, and any read outside the plan, each rank makes itself."""
        self._plan, self._next = self._agree(list(keys)), 0
        self._uses = Counter(key for key, _ in self._plan)
        try:
            self._prefetch()
            yield self
        except BaseException:
            self._reset()
            raise
        left = len(self._plan) - self._next
        self._reset()
        if left:  # the group's broadcasts no longer pair up: stop here rather than hang in the next one
            raise RuntimeError(f"the load asked for {left} fewer replicated arrays than its data-parallel group "
                               "agreed to share; this is a bug in the loader's dry run (planned_reads)")

    def _reset(self) -> None:
        self._plan, self._next, self._held, self._uses = [], 0, {}, Counter()

    def _agree(self, keys: list[tuple]) -> list[tuple[tuple, int]]:
        """(key, owner) for the reads every rank of the group makes, in the order they make them; none when the
        ranks' orders differ (each then reads for itself rather than risk broadcasts that do not pair up)."""
        mine = [k for k in keys if (e := self.expect(k)) is not None and _nbytes(e) > 0]
        everyone: list = [None] * self.dp
        dist.all_gather_object(everyone, mine, group=self.group)
        common = set(everyone[0]).intersection(*everyone[1:])
        orders = [[k for k in seq if k in common] for seq in everyone]
        if any(order != orders[0] for order in orders[1:]):
            return []
        unique = list(dict.fromkeys(orders[0]))
        owner = dict(zip(unique, assign_owners([_nbytes(self.expect(k)) for k in unique], self.dp)))
        return [(k, owner[k]) for k in orders[0]]

    def _prefetch(self) -> None:
        """Read this rank's share of the plan now; a failure on any rank is raised on every rank of the group (no
        rank is left waiting in a broadcast)."""
        from checkpoints.errors import CheckpointError

        error = None
        try:
            for key, owner in self._plan:
                if owner == self.dp_rank and key not in self._held:
                    self._held[key] = self.read_key(key).contiguous()
        except Exception as exc:  # reported to the group first, raised below
            error, failure = f"{type(exc).__name__}: {exc}", exc
        errors: list = [None] * self.dp
        dist.all_gather_object(errors, error, group=self.group)
        if error is not None:
            raise failure
        bad = next(((r, e) for r, e in enumerate(errors) if e is not None), None)
        if bad is not None:
            raise CheckpointError(f"data-parallel rank {bad[0]} could not read its share of {self.reader.path} "
                                  f"({bad[1]}); that rank's log has the details")

    def _serve(self, key: tuple):
        if self._next < len(self._plan) and self._plan[self._next][0] == key:
            owner = self._plan[self._next][1]
            self._next += 1
            return self._broadcast(key, owner)
        if self._uses[key]:
            raise RuntimeError(f"the load asked for {key} out of the order its data-parallel group agreed on; the "
                               "broadcasts would not pair up (a bug in the loader's dry run)")
        return self.read_key(key)

    def _broadcast(self, key: tuple, owner: int) -> torch.Tensor:
        """The planned read `key`, from the rank that read it, on the CPU."""
        self._uses[key] -= 1
        last = self._uses[key] == 0
        shape, dtype = self.expect(key)
        if owner == self.dp_rank:
            mine = self._held.pop(key) if last else self._held[key]
            dist.broadcast(mine.to(self.device).reshape(-1).view(torch.uint8),
                           src=dist.get_global_rank(self.group, owner), group=self.group)
            return mine if last else mine.clone()
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(buf.reshape(-1).view(torch.uint8), src=dist.get_global_rank(self.group, owner),
                       group=self.group)
        return buf.cpu()


def load_state(reader, model, optimizer, runtime, share: bool = True) -> ResumeIO:
    """Load the parameters and the optimizer state from `reader` as a resume does (collective: every rank calls
    it), sharing the replicated reads within each data-parallel group (share=False: every rank reads everything it
    loads, the old path, kept for measuring); what every rank read from `reader`, verification included."""
    from megaloop.optim.combined import join_names, parameter_names
    from megaloop.train.checkpointing import load_model, make_reader_fn

    read = make_reader_fn(reader, runtime, share)
    load_model(model, read)
    held = join_names(runtime.all_gather_object(parameter_names(optimizer)))  # every stage's
    load_optimizer_state(optimizer, read, reader.metadata["optimizer"], held)
    return gather_resume_io(reader, runtime)


def load_optimizer_state(optimizer, read: ShardReader, scalars: dict, held: dict) -> None:
    """megaloop.optim.combined.load_sharded_state through `read`, with the reads that every data-parallel rank
    makes alike (ZeRO stage 0's moments and Muon state) shared; the rows and matrices a rank owns it reads itself."""
    from megaloop.optim.combined import load_sharded_state

    with read.replicated(read.planned_reads(lambda r: load_sharded_state(optimizer, r, scalars, held))):
        load_sharded_state(optimizer, read, scalars, held)


@dataclass(frozen=True)
class ResumeIO:
    """What a resume read from the checkpoint, per rank in rank order: bytes checksummed by the verification, and
    bytes of chunk files read by the load, of the parameters (arrays model/...) and of the rest (the optimizer
    state); see checkpoints.load.CheckpointReader for what is counted."""

    verified: tuple[int, ...]
    params: tuple[int, ...]
    optimizer: tuple[int, ...]

    @property
    def per_rank(self) -> tuple[int, ...]:
        return tuple(sum(x) for x in zip(self.verified, self.params, self.optimizer))

    @property
    def total(self) -> int:
        return sum(self.per_rank)

    def describe(self) -> str:
        """One clause for the "resuming from ..." line."""
        ranks = len(self.per_rank)
        return (f"read {_size(self.total)} over {ranks} rank{'s' * (ranks > 1)} (verifying {_size(sum(self.verified))}"
                f", parameters {_size(sum(self.params))}, optimizer state {_size(sum(self.optimizer))}), at most "
                f"{_size(max(self.per_rank))} on one rank")

    def as_record(self) -> dict:
        """The fields of the metrics "resume" record."""
        return {"bytes_read": self.total, "bytes_read_max_rank": max(self.per_rank)}


def reader_figures(reader) -> tuple[int, int, int]:
    """(verified, parameter, other) bytes that `reader` has read."""
    params = sum(n for name, n in reader.bytes_by_array.items() if name.startswith("model/"))
    return int(reader.bytes_verified), int(params), int(reader.bytes_read - params)


def gather_resume_io(reader, runtime) -> ResumeIO:
    """Every rank's figures of `reader` (collective: every rank calls it)."""
    per_rank = runtime.all_gather_object(reader_figures(reader))
    return ResumeIO(*(tuple(column) for column in zip(*per_rank)))


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _nbytes(expected: tuple) -> int:
    shape, dtype = expected
    return math.prod(shape) * dtype.itemsize
