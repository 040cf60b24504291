"""The state a checkpoint holds, to and from a model and its optimizer: the pieces a rank saves, the reader the
model and the optimizers load through (this rank's tensor-parallel shard; shared over the data-parallel group,
megaloop.train.resume_io), and the full load of a resumed run with its checks (the same model, what differs)."""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field

import torch

from megaloop.config import Config
from megaloop.train.checkpointing.common import ResumeError
from megaloop.train.protocols import DataSource, TrainerRuntime


def state_pieces(model, optimizer, runtime: TrainerRuntime) -> tuple[list, dict]:
    """This rank's pieces of every global array (parameters and optimizer state) and the optimizer's scalars."""
    from checkpoints.pieces import Piece
    from megaloop.optim.combined import sharded_state
    from pipeline.state_regions import RowBlock, global_shape, row_regions, shard_regions

    entries = [(f"model/{name}", name, p.detach(), True) for name, p in model.named_parameters()]
    opt_entries, scalars = sharded_state(optimizer, spec_of=runtime.shard_spec)
    pieces = []
    for array, param, tensor, sharded in entries + opt_entries:
        spec = runtime.shard_spec(param) if sharded else None
        if isinstance(sharded, RowBlock):  # rows of the shard that this data-parallel rank writes
            shape = global_shape(sharded.shard_shape, spec)
            pieces += [Piece(array, shape, offsets, tensor[index])
                       for offsets, _, index in row_regions(sharded.shard_shape, spec, runtime.tp_rank,
                                                            sharded.start, sharded.stop)]
            continue
        pieces += [Piece(array, r.global_shape, r.offsets, r.local)
                   for r in shard_regions(tensor, spec, runtime.tp_rank)]
    return pieces, scalars


class ShardReader:
    """read(array, param, sharded) for the optimizers: the whole array, or this rank's tp shard of it; None when
    the checkpoint has no such array. rows(array, param, start, stop): rows [start, stop) of this rank's shard
    only (what a ZeRO-1 rank updates), reading just the chunks they touch.

    Every read is named by a key, ("read", array, param, sharded) or ("rows", array, param, start, stop), so that
    the reads several ranks make alike can be agreed on and shared (megaloop.train.resume_io.DpSharedReader, which
    make_reader_fn returns under data parallelism). This reader shares nothing: each rank reads what it asks for,
    and replicated() and planned_reads() do nothing."""

    def __init__(self, reader, runtime: TrainerRuntime):
        self.reader, self.runtime = reader, runtime

    def _shard(self, array: str, param: str):
        info = self.reader.arrays.get(array)
        if info is None:
            return None, None, None
        spec = self.runtime.shard_spec(param)
        local_shape = list(info.shape)
        if spec is not None:
            local_shape[spec.dim] //= spec.tp
        return info, spec, tuple(local_shape)

    def _region(self, array: str):
        return lambda offsets, shape: self.reader.read(array, offsets, shape)

    def __call__(self, array: str, param: str, sharded: bool):
        return self.read_key(("read", array, param, bool(sharded)))

    def rows(self, array: str, param: str, start: int, stop: int):
        return self.read_key(("rows", array, param, int(start), int(stop)))

    def read_key(self, key: tuple):
        """The read named by `key`, from the checkpoint's files (None: no such array)."""
        from pipeline.state_regions import read_rows, read_shard

        kind, array, param, *where = key
        info, spec, local_shape = self._shard(array, param)
        if info is None:
            return None
        if kind == "rows":
            return read_rows(self._region(array), local_shape, spec, self.runtime.tp_rank, *where)
        if not where[0]:
            return self.reader.read(array)
        return read_shard(self._region(array), local_shape, spec, self.runtime.tp_rank)

    def expect(self, key: tuple) -> tuple[tuple[int, ...], torch.dtype] | None:
        """(shape, dtype) of what the read `key` returns, without reading; None when the checkpoint has no such
        array."""
        kind, array, param, *where = key
        info, _, local_shape = self._shard(array, param)
        if info is None:
            return None
        if kind == "rows":
            start, stop = where
            return ((stop - start,) + local_shape[1:] if local_shape else ()), info.dtype
        return (local_shape if where[0] else tuple(info.shape)), info.dtype

    def replicated(self, keys: list[tuple]):
        """A context in which the reads `keys` (made alike by every data-parallel rank) are shared; here: none."""
        return contextlib.nullcontext()

    def planned_reads(self, load) -> list[tuple]:
        """The keys load(read) would read (a dry run), for replicated(); here no dry run is needed: []."""
        return []


def make_reader_fn(reader, runtime: TrainerRuntime, share: bool = True) -> ShardReader:
    """The reader the model and the optimizers load through (see :class:`ShardReader`): with data parallelism and
    `share`, one that reads each replicated array on one rank of the data-parallel group and broadcasts it
    (megaloop.train.resume_io); share=False: every rank reads everything it loads (the old path, kept for
    measuring)."""
    layout = runtime.layout
    if share and layout is not None and layout.dp > 1 and layout.dp_group is not None:
        from megaloop.train.resume_io import DpSharedReader

        return DpSharedReader(reader, runtime)
    return ShardReader(reader, runtime)


def load_model(model, read) -> None:
    """Copy every parameter from the checkpoint (this rank's shard), refusing a missing or mis-shaped one. The
    parameters are the same on every data-parallel rank, so their reads are shared (read.replicated)."""
    named = list(model.named_parameters())
    with read.replicated([("read", f"model/{name}", name, True) for name, _ in named]), torch.no_grad():
        for name, p in named:
            value = read(f"model/{name}", name, True)
            if value is None:
                raise ResumeError(f"the checkpoint has no parameter {name!r}: it was saved for another model; "
                                  "resume with the config that saved it")
            if tuple(value.shape) != tuple(p.shape):
                raise ResumeError(f"parameter {name!r} has shape {tuple(value.shape)} in the checkpoint but "
                                  f"{tuple(p.shape)} here: the model config differs from the saving run's")
            p.copy_(value.to(dtype=p.dtype, device=p.device))


def weights_fit(arrays: dict, cfg: Config) -> bool:
    """Whether a checkpoint's arrays hold every parameter of cfg's model with its global shape (so that
    checkpoint.load_optimizer=false can start this model from them)."""
    from megaloop.model import build_model

    model = build_model(cfg.model, device="meta")
    return all(f"model/{n}" in arrays and tuple(arrays[f"model/{n}"].shape) == tuple(p.shape)
               for n, p in model.named_parameters())


def config_differences(saved: dict, current: dict, section: str) -> list[str]:
    a, b = saved.get(section, {}), current.get(section, {})
    return [f"{section}.{k}: saved {a.get(k)!r}, now {b.get(k)!r}" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]


@dataclass
class Resumed:
    """What a full load brought back besides the model, optimizer and data position."""

    step: int
    tokens: int
    path: str
    trainer_state: dict = field(default_factory=dict)  # the checkpoint's "trainer" metadata (tracked parts)
    resume_io: object = None  # what the load read (megaloop.train.resume_io.ResumeIO)


def load_full(reader, cfg: Config, runtime: TrainerRuntime, model, optimizer, data: DataSource, note,
              share_reads: bool = True) -> Resumed:
    """Load everything a run continues from (the model, the optimizer state and counters, the schedule's horizon,
    the data position), refusing a checkpoint of another model or one that holds weights only."""
    from megaloop.train.rerun import schedule_horizon
    from megaloop.train.resume_io import load_state

    meta = reader.metadata
    missing = [key for key in ("config", "optimizer", "loader") if key not in meta]
    if missing:
        raise ResumeError(f"checkpoint {reader.path} holds weights only (no {', '.join(missing)}; e.g. one "
                          "converted from the official implementation): start from it with "
                          "checkpoint.resume=... checkpoint.load_optimizer=false")
    current = json.loads(json.dumps(cfg.to_dict()))  # as the metadata holds it (tuples become lists)
    diffs = config_differences(meta["config"], current, "model")
    if diffs:
        weights = (f"or start a new run from its weights in another train.out_dir with checkpoint.resume="
                   f"{reader.path} checkpoint.load_optimizer=false" if weights_fit(reader.arrays, cfg)
                   else "its parameter shapes differ from this model's, so not even its weights can start it")
        raise ResumeError(f"checkpoint {reader.path} was saved for another model ({'; '.join(diffs[:3])}): "
                          f"resume with the config that saved it, {weights}")
    for diff in config_differences(meta["config"], current, "optim"):
        note(f"note: {diff} (continuing with the new value)")
    resume_io = load_state(reader, model, optimizer, runtime, share_reads)  # and what it read
    if hasattr(optimizer, "total_steps"):
        optimizer.total_steps = schedule_horizon(meta, cfg, int(reader.step), note)
    data.load_state_dict(meta["loader"])
    resumed = Resumed(int(reader.step), int(meta.get("tokens", 0)), str(reader.path),
                      dict(meta.get("trainer", {})), resume_io)
    saved, now = meta.get("layout", {}), runtime.describe_layout()
    note(f"resuming from {reader.path} (step {reader.step}, {resumed.tokens:,} tokens; saved with "
         f"tp={saved.get('tp')} pp={saved.get('pp', 1)} dp={saved.get('dp')}, now tp={now['tp']} "
         f"pp={now.get('pp', 1)} dp={now['dp']}); {resume_io.describe()}")
    return resumed
