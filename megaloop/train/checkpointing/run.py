"""RunCheckpoints: saving and resuming one training job, from the parts of this package (the resume policy,
verification, the shelf of set-aside checkpoints, the failure policy of saves, the markers). Every method is called
by every rank at the same point."""
from __future__ import annotations

import functools
import time
from pathlib import Path

import torch

from megaloop.config import Config
from megaloop.train.checkpointing.aside import Shelf
from megaloop.train.checkpointing.common import METADATA_VERSION, checkpoint_root, note
from megaloop.train.checkpointing.markers import write_marker
from megaloop.train.checkpointing.outcomes import SaveOutcomes
from megaloop.train.checkpointing.resume import ResumePolicy
from megaloop.train.checkpointing.state import load_full, load_model, make_reader_fn, state_pieces
from megaloop.train.checkpointing.verify import open_verified
from megaloop.train.protocols import DataSource, TrainerRuntime


class RunCheckpoints:
    """Saving and resuming one training job (see the package docstring)."""

    def __init__(self, cfg: Config, runtime: TrainerRuntime):
        self.cfg, self.runtime = cfg, runtime
        self.root = checkpoint_root(cfg)
        self.enabled = cfg.parallel.engine == "native"
        self.tokens_before = 0
        self.resumed_step = 0
        self.resumed_from: str | None = None
        self.resume_io = None  # what the resume read (megaloop.train.resume_io.ResumeIO), once loaded
        self.last_saved_step: int | None = None
        self._note = functools.partial(note, runtime)
        self.shelf = Shelf(self.root, runtime, self._note)
        self.policy = ResumePolicy(cfg, runtime, self.root, self.shelf, self._note)
        self.outcomes = SaveOutcomes(runtime, self.root)
        self._checkpointer = None
        self._tracked: dict = {}  # name -> object with state_dict()/load_state_dict(), saved as metadata "trainer"
        self._trainer_state: dict = {}  # the resumed checkpoint's "trainer" metadata, loaded by track()

    # ---- the trainer's own stateful parts --------------------------------------------------------------------
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
        return self.enabled and bool(self.policy.own() or self.cfg.checkpoint.resume is not None)

    def restore(self, model, optimizer, data: DataSource, share_reads: bool = True) -> int:
        """Load the state the run continues from (megaloop.train.checkpointing.resume); the first step to run.
        share_reads=False: every rank reads all it loads (the old path, for measuring; megaloop.train.resume_io)."""
        if not self.enabled:
            self._note("no checkpoints under parallel.engine=deepspeed (its partitioned optimizer state is not saved "
                       "as layout-free arrays); use the native engine for runs that must resume")
            self.policy.refuse_used_out_dir()
            return 0
        own, resume = self.policy.own(), self.cfg.checkpoint.resume
        if own:
            self._load_full(self._open_verified(own), model, optimizer, data, share_reads)
        elif resume is not None:
            self.policy.refuse_used_out_dir()
            reader = self._open_verified(self.policy.resume_candidates(Path(resume)))
            if self.cfg.checkpoint.load_optimizer:
                self._load_full(reader, model, optimizer, data, share_reads)
            else:
                self._load_weights(reader, model, share_reads)
        else:
            self.policy.refuse_used_out_dir()
        return self.resumed_step

    def roll_back(self, model, optimizer, data: DataSource, before_step: int, keep: tuple[str, ...] = ()
                  ) -> int | None:
        """Load this run's newest committed checkpoint of a step before `before_step` (model, optimizer, data
        position, and the state of the tracked parts except those named in `keep`, which go on as they are); the
        step loaded, or None when there is none (the run's state is then untouched)."""
        self.wait()  # the save in flight lands (or fails) first
        candidates = self.policy.own(before_step=before_step)
        if not candidates:
            return None
        self._load_full(self._open_verified(candidates), model, optimizer, data)
        for name, part in self._tracked.items():
            if name not in keep and name in self._trainer_state:
                part.load_state_dict(self._trainer_state[name])
        return self.resumed_step

    def set_aside_from(self, step: int, suffix: str) -> None:
        """Set aside (as <name>.<suffix>) this run's committed checkpoints of `step` or later, so that the newest
        one left is from before it (a loss spike's step)."""
        if self.enabled:
            self.wait()
            self.last_saved_step = self.shelf.set_aside_from(step, suffix)

    def _open_verified(self, candidates: list[Path]):
        return open_verified(candidates, self.runtime, self.shelf.set_aside, self._note)

    def _load_full(self, reader, model, optimizer, data: DataSource, share_reads: bool = True) -> None:
        resumed = load_full(reader, self.cfg, self.runtime, model, optimizer, data, self._note, share_reads)
        self._trainer_state, self.resume_io = resumed.trainer_state, resumed.resume_io
        self.resumed_step = self.last_saved_step = resumed.step
        self.tokens_before, self.resumed_from = resumed.tokens, resumed.path

    def _load_weights(self, reader, model, share_reads: bool) -> None:
        """checkpoint.load_optimizer=false: the weights only."""
        from megaloop.train.resume_io import gather_resume_io

        load_model(model, make_reader_fn(reader, self.runtime, share_reads))
        self.resume_io = gather_resume_io(reader, self.runtime)
        self._note(f"initialised the weights from {reader.path} (step {reader.step}); optimizer, data "
                   f"order and schedule start at step 0; {self.resume_io.describe()}")
        self.resumed_from = str(reader.path)

    # ---- saving ----------------------------------------------------------------------------------------------
    def save(self, step: int, model, optimizer, data: DataSource, tokens: int, data_step: int | None = None,
             wait: bool = False) -> None:
        """Save the state after `step` optimizer steps, the run having trained `tokens` tokens (asynchronously unless
        `wait`; the next save waits). data_step: the global batch the loader must be at (step, unless rollbacks
        skipped batches). wait: the save must land (the final or stop save): a failure raises SaveFailed."""
        from megaloop.train.runtime import phase_timeout

        if not self.enabled or step == self.last_saved_step:
            return
        p = self.cfg.parallel
        with phase_timeout(self.runtime, p.startup_timeout_s, then=p.timeout_s):  # ranks wait on the slowest
            self._save(step, model, optimizer, data, tokens, step if data_step is None else data_step, wait)

    def _save(self, step: int, model, optimizer, data: DataSource, tokens: int, data_step: int, wait: bool) -> None:
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
        if loader["step"] != data_step:
            raise RuntimeError(f"the data loader is at global batch {loader['step']} after {step} steps, not at "
                               f"{data_step}")
        metadata = {"megaloop_checkpoint": METADATA_VERSION, "config": self.cfg.to_dict(),
                    "tokens": tokens, "layout": self.runtime.describe_layout(),
                    "loader": loader, "optimizer": scalars,
                    "schedule_steps": getattr(optimizer, "total_steps", self.cfg.train.steps),
                    "trainer": {name: part.state_dict() for name, part in self._tracked.items()},
                    "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "torch": torch.__version__}
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
        """Block until the save in flight is written (and, on rank 0, committed), then settle its outcome by the
        failure policy (megaloop.train.checkpointing.outcomes). must_land: the final or stop save. agree=False
        (closing, maybe while an error unwinds on some ranks only): no collective, and a failure is never raised."""
        if self._checkpointer is None:
            return
        # with agreement, a barrier tells rank 0 that every part is written: it commits at once, not at its next
        # once-a-second look at the staging directory
        self._checkpointer.wait(self.runtime.barrier if agree else None)
        results = self._checkpointer.take_results()
        if results:
            self.outcomes.settle(results, must_land, agree)

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

    # ---- the save figures and the metrics writer -------------------------------------------------------------
    @property
    def record(self):
        """The run's metrics writer, for "checkpoint_failed" records (set by the loop once it exists)."""
        return self.outcomes.record

    @record.setter
    def record(self, write) -> None:
        self.outcomes.record = write

    @property
    def slowest_stall_s(self) -> float:
        return self.outcomes.slowest_stall_s

    @property
    def slowest_write_s(self) -> float:
        return self.outcomes.slowest_write_s

    @property
    def slowest_save_s(self) -> float:
        """The longest save so far (training stall + background write, the job's), for the time budget."""
        return self.outcomes.slowest_stall_s + self.outcomes.slowest_write_s

    # ---- markers for batch scripts ---------------------------------------------------------------------------
    def mark(self, kind: str | None, **info) -> None:
        """Rank 0 leaves <out_dir>/STOPPED (an agreed stop saved: requeue the job) or COMPLETED (train.steps done)
        for a batch script to read, and removes the other; kind None removes both (at the start of a job)."""
        if not self.runtime.is_main or (kind == "STOPPED" and not self.enabled):  # nothing to resume from
            return
        write_marker(self.cfg.train.out_dir, kind, **info)
