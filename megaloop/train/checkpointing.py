"""The trainer's side of checkpoints/: what a training run saves, where it resumes from, and the agreed stop.

A checkpoint holds, as layout-free global arrays (see checkpoints/), every parameter under `model/<name>` and the
optimizer state under `optim/...` (megaloop.optim.combined.sharded_state), plus JSON metadata: the config, the step,
tokens seen, the saving layout, the data loader's position, the steps the learning-rate schedule spans (see
megaloop.train.rerun.schedule_horizon), the optimizer's counters and AdamW step counts (the
job's: under pipeline parallelism each rank's optimizer covers one stage, so they are merged over the ranks at save
and each rank takes its parameters' at load; the stages' parameter names together must be the saved ones), and the
state of the trainer's own stateful parts registered with :meth:`RunCheckpoints.track` (the loss-spike detector's
window, whose decisions under train.on_spike=skip change the updates). With these, a resumed run repeats the
uninterrupted one bit for bit: the depths, h_0 noise and data order are functions of (seed, step, sample index),
and nothing else in the trainer carries state across steps.

Where a run starts (:meth:`RunCheckpoints.restore`):
  1. the newest committed checkpoint under checkpoint.dir (default <train.out_dir>/checkpoints) that verifies, so
     re-running the same command continues a run (a job requeued after a preemption does exactly this);
  2. otherwise checkpoint.resume (another run's checkpoint: a step directory or a checkpoint root), with
     checkpoint.load_optimizer=false for the weights only (a fresh optimizer, data and schedule from step 0);
  3. otherwise from scratch; an out_dir that holds the metrics of an attempt that committed no checkpoint starts
     afresh with those metrics set aside (megaloop.train.rerun), one that holds a COMPLETED run is refused.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from megaloop.config import Config
from megaloop.train.protocols import DataSource, TrainerRuntime

STOP_EXIT_CODE = 75  # sysexits' EX_TEMPFAIL: the run stopped early on request and saved; run it again to continue
METADATA_VERSION = 1
MARKERS = ("STOPPED", "COMPLETED")


class ResumeError(ValueError):
    """A checkpoint that cannot continue this run (another model, nothing loadable, an out_dir already used)."""


class SaveFailed(RuntimeError):
    """A checkpoint that had to land did not: the final or stop save, or periodic saves failing in a row. The job
    exits non-zero and leaves no COMPLETED/STOPPED marker, so that a batch script neither marks the run done nor
    requeues it as if it had saved."""


MAX_FAILED_SAVES = 2  # periodic saves failing in a row that stop the run (see RunCheckpoints.wait)


def mark_startup_stop(cfg: Config, signal_name: str) -> None:
    """<out_dir>/STOPPED for a stop signal during start-up (call on rank 0): nothing new was trained, so the step is
    the newest committed checkpoint's (0: none), and "during": "start-up" tells a batch script that this stop made no
    progress by design (slurm/body.py requeues it unless the previous job also stopped during start-up at that
    step: then start-up alone outlasts the allocation)."""
    from checkpoints.files import step_of
    from checkpoints.load import find_checkpoints

    steps = [step_of(p.name) for p in find_checkpoints(checkpoint_root(cfg))] if cfg.parallel.engine == "native" \
        else []
    out = Path(cfg.train.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "COMPLETED").unlink(missing_ok=True)
    tmp = out / ".STOPPED.tmp"
    tmp.write_text(json.dumps({"step": max([s for s in steps if s is not None], default=0),
                               "reason": f"{signal_name} during start-up", "during": "start-up"}) + "\n")
    tmp.replace(out / "STOPPED")


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.train.out_dir) / "checkpoints"


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
    only (what a ZeRO-1 rank updates), reading just the chunks they touch."""

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
        from pipeline.state_regions import read_shard

        info, spec, local_shape = self._shard(array, param)
        if info is None:
            return None
        if not sharded:
            return self.reader.read(array)
        return read_shard(self._region(array), local_shape, spec, self.runtime.tp_rank)

    def rows(self, array: str, param: str, start: int, stop: int):
        from pipeline.state_regions import read_rows

        info, spec, local_shape = self._shard(array, param)
        if info is None:
            return None
        return read_rows(self._region(array), local_shape, spec, self.runtime.tp_rank, start, stop)


def make_reader_fn(reader, runtime: TrainerRuntime) -> ShardReader:
    """The reader the model and the optimizers load through (see :class:`ShardReader`)."""
    return ShardReader(reader, runtime)


def load_model(model, read) -> None:
    """Copy every parameter from the checkpoint (this rank's shard), refusing a missing or mis-shaped one."""
    with torch.no_grad():
        for name, p in model.named_parameters():
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


def verify_share(sizes: dict[str, int], rank: int, world: int) -> list[str]:
    """The arrays this rank verifies: balanced by bytes over the ranks (largest first to the least loaded), so that
    together they read the checkpoint once."""
    from pipeline.dist_muon import assign_owners

    names = sorted(sizes)
    return [n for n, owner in zip(names, assign_owners([sizes[n] for n in names], world)) if owner == rank]


class RunCheckpoints:
    """Saving and resuming one training job; every method is called by every rank at the same point."""

    def __init__(self, cfg: Config, runtime: TrainerRuntime):
        self.cfg, self.runtime = cfg, runtime
        self.root = checkpoint_root(cfg)
        self.enabled = cfg.parallel.engine == "native"
        self.tokens_before = 0
        self.resumed_step = 0
        self.resumed_from: str | None = None
        self.last_saved_step: int | None = None
        self.saved: list[tuple[int, float, float]] = []  # (step, training stall s, background write s), rank 0
        self.failed_in_a_row = 0
        self.record = lambda record: None  # the run's metrics writer (set by the loop once it exists)
        self._checkpointer = None
        self._own: list[Path] | None = None
        self._tracked: dict = {}  # name -> object with state_dict()/load_state_dict(), saved as metadata "trainer"
        self._trainer_state: dict = {}  # the resumed checkpoint's "trainer" metadata, loaded by track()

    def track(self, name: str, part) -> None:
        """Save `part.state_dict()` (JSON-able, identical on every rank) with every checkpoint under `name`, and load
        the resumed checkpoint's state into it now (call after restore(); a checkpoint without it leaves it fresh)."""
        self._tracked[name] = part
        if name in self._trainer_state:
            part.load_state_dict(self._trainer_state[name])

    # ---- where the run starts --------------------------------------------------------------------------------
    def loads_weights(self) -> bool:
        """Whether restore() will fill every parameter from a checkpoint (this run's own, or checkpoint.resume), so
        that the model need not be initialised; restore() then loads one or raises, it never starts afresh."""
        return self.enabled and bool(self._own_checkpoints() or self.cfg.checkpoint.resume is not None)

    def _own_checkpoints(self) -> list[Path]:
        """This run's committed checkpoints, newest first, as rank 0 sees them (looked up once per job)."""
        from checkpoints.load import find_checkpoints

        if self._own is None:  # rank 0's view decides, so that every rank takes the same branch
            self._own = [Path(p) for p in
                         self.runtime.all_gather_object([str(p) for p in find_checkpoints(self.root)])[0]]
        return self._own

    def restore(self, model, optimizer, data: DataSource) -> int:
        """Load the state the run continues from (see the module docstring); returns the first step to run."""
        if not self.enabled:
            self._note("no checkpoints under parallel.engine=deepspeed (its partitioned optimizer state is not saved "
                       "as layout-free arrays); use the native engine for runs that must resume")
            self._refuse_used_out_dir()
            return 0
        own = self._own_checkpoints()
        resume = self.cfg.checkpoint.resume
        if own:
            reader = self._open_verified(own)
            self._load_full(reader, model, optimizer, data)
        elif resume is not None:
            self._refuse_used_out_dir()
            reader = self._open_verified(self._resume_candidates(Path(resume)))
            if self.cfg.checkpoint.load_optimizer:
                self._load_full(reader, model, optimizer, data)
            else:
                load_model(model, make_reader_fn(reader, self.runtime))
                self._note(f"initialised the weights from {reader.path} (step {reader.step}); optimizer, data "
                           "order and schedule start at step 0")
                self.resumed_from = str(reader.path)
        else:
            self._refuse_used_out_dir()
        return self.resumed_step

    def _resume_candidates(self, path: Path) -> list[Path]:
        from checkpoints.load import find_checkpoints

        if (path / "COMMIT").is_file():
            return [path]
        found = find_checkpoints(path) if path.is_dir() else []
        if not found:
            raise ResumeError(f"checkpoint.resume={str(path)!r} is not a committed checkpoint nor a directory "
                              "holding one: point it at a step_XXXXXXXX directory or at a checkpoint root")
        return found

    def _unusable_checkpoints(self) -> bool:
        """This run's checkpoints were all set aside as corrupt (<name>.corrupt) and none is left."""
        return any(self.root.glob("step_*.corrupt")) if self.root.is_dir() else False

    def _refuse_used_out_dir(self) -> None:
        """A fresh start in an out_dir that holds metrics but no checkpoint: refused when that run COMPLETED (its
        record must stay); otherwise the earlier attempt ended before its first checkpoint (killed, a data error),
        so its metrics are set aside and the run starts afresh, as re-running the same command promises."""
        from megaloop.train.rerun import set_aside_metrics

        out = Path(self.cfg.train.out_dir)
        used, completed, corrupt = self.runtime.all_gather_object(((out / "metrics.jsonl").exists(),
                                                                   (out / "COMPLETED").exists(),
                                                                   self._unusable_checkpoints()))[0]
        if used and completed and not corrupt:
            raise ResumeError(f"train.out_dir={str(out)!r} already holds a completed run (COMPLETED, metrics.jsonl) "
                              f"and no checkpoint to continue it from ({self.root}): choose another train.out_dir, "
                              f"or delete {str(out)!r} to start over")
        if used:
            if self.runtime.is_main:
                aside = set_aside_metrics(out)
                if completed:  # its checkpoints were all unusable: the run is trained again
                    (out / "COMPLETED").rename(out / f"COMPLETED.{aside.split('.')[1]}")
                why = ("whose checkpoints were all unusable (set aside as *.corrupt)" if corrupt
                       else "that committed no checkpoint")
                self._note(f"{str(out)!r} holds an attempt {why}: starting the run afresh (its metrics are kept "
                           f"as {aside})")
            self.runtime.barrier()  # no rank starts writing before the old metrics are out of the way

    def _open_verified(self, candidates: list[Path]):
        """The newest candidate whose files verify on every rank (each rank checks a share of the arrays); one that
        fails is said in one line (what was found, what happens next), set aside when it is this run's own, and the
        previous one is tried."""
        from checkpoints.errors import CheckpointError
        from checkpoints.load import CheckpointReader

        shown = candidates[-1]
        for index, path in enumerate(candidates):
            error = None
            try:
                reader = CheckpointReader(path)
                sizes = {n: int(torch.Size(a.shape).numel()) for n, a in reader.arrays.items()}
                reader.verify(verify_share(sizes, self.runtime.rank, self.runtime.world_size))
            except CheckpointError as err:
                error = str(err)
            errors = [e for e in self.runtime.all_gather_object(error) if e]
            if not errors:
                return reader
            shown = self._set_aside(path)
            moved = f", set aside as {shown.name}" if shown != path else ""
            nxt = (f"resuming from {candidates[index + 1].name} instead" if index + 1 < len(candidates)
                   else "no other checkpoint to resume from")
            self._note(f"checkpoint {path.name} is unusable ({_first_problem(errors[0], path)}){moved}; {nxt}")
        if shown != candidates[-1]:  # set aside (this run's own checkpoints): the next attempt starts afresh
            todo = "run the same command again to start the run afresh (its metrics are kept beside the new ones)"
        else:
            todo = "point checkpoint.resume at another checkpoint, or leave it null to start afresh"
        raise ResumeError(f"no checkpoint could be loaded (`python -m checkpoints verify {shown}` shows what is "
                          f"wrong); {todo}")

    def _set_aside(self, path: Path) -> Path:
        """Rename a corrupt checkpoint of this run to <name>.corrupt (kept for inspection, no longer counted by
        retention nor tried again) and point `latest` at the newest committed checkpoint left (or remove it when
        none is left), so that `latest` never names a checkpoint that is not there; another run's checkpoints are
        never touched. Where the checkpoint is now."""
        from checkpoints import files
        from checkpoints.load import find_checkpoints

        self.runtime.barrier()  # every rank is done reading it
        aside = path.with_name(f"{path.name}.corrupt")
        if path.parent.resolve() != self.root.resolve():
            return path
        moved = False
        if self.runtime.is_main and not aside.exists():
            path.rename(aside)
            left = [p for p in find_checkpoints(self.root) if p.name != path.name]
            if left:
                files.atomic_write_text(self.root / "latest", max(left, key=lambda p: p.name).name + "\n")
            else:
                (self.root / "latest").unlink(missing_ok=True)
            moved = True
        moved = self.runtime.all_gather_object(moved)[0]  # rank 0's verdict; `latest` is settled for every rank
        return aside if moved else path

    def _load_full(self, reader, model, optimizer, data: DataSource) -> None:
        from megaloop.optim.combined import join_names, load_sharded_state, parameter_names
        from megaloop.train.rerun import schedule_horizon

        meta = reader.metadata
        missing = [key for key in ("config", "optimizer", "loader") if key not in meta]
        if missing:
            raise ResumeError(f"checkpoint {reader.path} holds weights only (no {', '.join(missing)}; e.g. one "
                              "converted from the official implementation): start from it with "
                              "checkpoint.resume=... checkpoint.load_optimizer=false")
        current = json.loads(json.dumps(self.cfg.to_dict()))  # as the metadata holds it (tuples become lists)
        diffs = config_differences(meta["config"], current, "model")
        if diffs:
            weights = (f"or start a new run from its weights in another train.out_dir with checkpoint.resume="
                       f"{reader.path} checkpoint.load_optimizer=false" if weights_fit(reader.arrays, self.cfg)
                       else "its parameter shapes differ from this model's, so not even its weights can start it")
            raise ResumeError(f"checkpoint {reader.path} was saved for another model ({'; '.join(diffs[:3])}): "
                              f"resume with the config that saved it, {weights}")
        for diff in config_differences(meta["config"], current, "optim"):
            self._note(f"note: {diff} (continuing with the new value)")
        read = make_reader_fn(reader, self.runtime)
        load_model(model, read)
        held = join_names(self.runtime.all_gather_object(parameter_names(optimizer)))  # every stage's
        load_sharded_state(optimizer, read, meta["optimizer"], held)
        if hasattr(optimizer, "total_steps"):
            optimizer.total_steps = schedule_horizon(meta, self.cfg, int(reader.step), self._note)
        data.load_state_dict(meta["loader"])
        self._trainer_state = dict(meta.get("trainer", {}))
        self.resumed_step = int(reader.step)
        self.tokens_before = int(meta.get("tokens", 0))
        self.last_saved_step = self.resumed_step
        self.resumed_from = str(reader.path)
        saved, now = meta.get("layout", {}), self.runtime.describe_layout()
        self._note(f"resuming from {reader.path} (step {reader.step}, {self.tokens_before:,} tokens; saved with "
                   f"tp={saved.get('tp')} pp={saved.get('pp', 1)} dp={saved.get('dp')}, now tp={now['tp']} "
                   f"pp={now.get('pp', 1)} dp={now['dp']})")

    # ---- saving ----------------------------------------------------------------------------------------------
    def save(self, step: int, model, optimizer, data: DataSource, tokens_this_job: int, wait: bool = False) -> None:
        """Save the state after `step` optimizer steps (asynchronously unless `wait`; the next save waits). wait: the
        save must land (the final or stop save): a failure raises SaveFailed (see wait)."""
        from megaloop.train.runtime import phase_timeout

        if not self.enabled or step == self.last_saved_step:
            return
        p = self.cfg.parallel
        with phase_timeout(self.runtime, p.startup_timeout_s, then=p.timeout_s):  # ranks wait on the slowest
            self._save(step, model, optimizer, data, tokens_this_job, wait)

    def _save(self, step: int, model, optimizer, data: DataSource, tokens_this_job: int, wait: bool) -> None:
        from megaloop.optim.combined import merge_scalars

        self.runtime.finish_param_gather()  # the parameters read below hold their new values
        pieces, scalars = state_pieces(model, optimizer, self.runtime)
        refuse = None
        per_rank = self.runtime.gather_object(scalars)  # every stage's parameters, on rank 0 (which writes metadata)
        if per_rank is not None:
            try:
                scalars = merge_scalars(per_rank)
            except ValueError as exc:  # every rank refuses this save alike, through the checkpointer's agreement
                refuse = str(exc)
        loader = data.state_dict()
        if loader["step"] != step:
            raise RuntimeError(f"the data loader is at global batch {loader['step']} after {step} steps")
        metadata = {"megaloop_checkpoint": METADATA_VERSION, "config": self.cfg.to_dict(),
                    "tokens": self.tokens_before + tokens_this_job, "layout": self.runtime.describe_layout(),
                    "loader": loader, "optimizer": scalars,
                    "schedule_steps": getattr(optimizer, "total_steps", self.cfg.train.steps),
                    "trainer": {name: part.state_dict() for name, part in self._tracked.items()}, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "torch": torch.__version__}
        self.wait()  # the previous save: its outcome is reported before this one starts
        self._saver().save(step, pieces, metadata, refuse=refuse)
        self.last_saved_step = step
        if wait:
            self.wait(must_land=True)

    def prepare(self, model, optimizer) -> None:
        """Allocate the snapshot buffers in the background (call once the optimizer state exists), so that no save
        pays for fresh memory on the training thread."""
        if self.enabled:
            self._saver().prepare(state_pieces(model, optimizer, self.runtime)[0])

    def wait(self, must_land: bool = False, agree: bool = True) -> None:
        """Block until the save in flight is written (and, on rank 0, committed); report a failure, as a line and a
        metrics record. A failed periodic save lets training go on (the previous checkpoint is still committed and
        the next save tries again: a transient file-system error must not end a job of hundreds of GPUs), but
        MAX_FAILED_SAVES in a row raise SaveFailed: the storage is broken and the job would train on with nothing
        to resume from. must_land (the final or stop save): any failure raises SaveFailed. Every rank agrees (one
        reduction), since ranks other than 0 only see their own part; agree=False (closing, maybe while an error
        unwinds on some ranks only): no reduction, and a failure is reported, never raised."""
        if self._checkpointer is None:
            return
        # with agreement, a barrier tells rank 0 that every part is written: it commits at once, not at its next
        # once-a-second look at the staging directory
        self._checkpointer.wait(self.runtime.barrier if agree else None)
        results = self._checkpointer.take_results()
        if not results:
            return
        errors = [r for r in results if not r.ok]
        for result in results:
            if result.ok and self.runtime.is_main:
                self.saved.append((result.step, result.stall_s, result.write_s))
        step = max(r.step for r in results)
        failed = self.runtime.world_max(float(bool(errors))) if agree else bool(errors)
        if not failed:
            self.failed_in_a_row = 0
            return
        self.failed_in_a_row += 1
        error = errors[0].error if errors else "failed on another rank (its error is in its log)"
        fatal = agree and (must_land or self.failed_in_a_row >= MAX_FAILED_SAVES)
        self.record({"kind": "checkpoint_failed", "step": step, "error": error, "in_a_row": self.failed_in_a_row,
                     "fatal": fatal})
        if fatal:
            what = ("the final checkpoint" if must_land else f"{self.failed_in_a_row} checkpoints in a row")
            raise SaveFailed(f"{what} (step {step}) FAILED and {'was' if must_land else 'were'} not committed "
                             f"({error}); the run is not marked COMPLETED or STOPPED. Fix the storage "
                             f"({self.root}), then run the same command again: it resumes from the last committed "
                             "checkpoint")
        if errors:
            print(f"megaloop: checkpoint of step {step} FAILED and was not committed ({error}); training goes on "
                  f"and the next save tries again ({MAX_FAILED_SAVES} failures in a row stop the run)",
                  file=sys.stderr, flush=True)

    def _saver(self):
        if self._checkpointer is None:
            from checkpoints.save import Checkpointer

            self._checkpointer = Checkpointer(self.root, rank=self.runtime.rank, world_size=self.runtime.world_size,
                                              gather_object=self.runtime.gather_object,
                                              scatter_object=self.runtime.scatter_object,
                                              keep=self.cfg.checkpoint.keep, async_save=self.cfg.checkpoint.async_save)
        return self._checkpointer

    def close(self) -> None:
        if self._checkpointer is not None:
            self.wait(agree=False)
            self._checkpointer.close()
            self._checkpointer = None

    @property
    def slowest_save_s(self) -> float:
        """The longest save so far (training stall + background write), for the time budget."""
        return max((stall + write for _, stall, write in self.saved), default=0.0)

    # ---- markers for batch scripts ---------------------------------------------------------------------------
    def mark(self, kind: str | None, **info) -> None:
        """Rank 0 leaves <out_dir>/STOPPED (an agreed stop saved: requeue the job) or COMPLETED (train.steps done)
        for a batch script to read, and removes the other; kind None removes both (at the start of a job)."""
        if not self.runtime.is_main or (kind == "STOPPED" and not self.enabled):  # nothing to resume from
            return
        out = Path(self.cfg.train.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for name in MARKERS:
            if name != kind:
                (out / name).unlink(missing_ok=True)
        if kind is not None:
            tmp = out / f".{kind}.tmp"
            tmp.write_text(json.dumps(info) + "\n")
            tmp.replace(out / kind)

    def _note(self, message: str) -> None:
        if self.runtime.is_main:
            print(f"megaloop: {message}", file=sys.stderr, flush=True)


def _first_problem(error: str, path: Path) -> str:
    """A verification error without the checkpoint's path, which the line names already, and cut to its first
    sentence."""
    text = error.replace(f"{path}/", "").replace(f"{path}: ", "").replace(str(path), path.name)
    return text.split("; ")[0]
