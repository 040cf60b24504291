"""Where a run starts (the resume policy):
  1. the newest committed checkpoint under checkpoint.dir (default <train.out_dir>/checkpoints) that verifies, so
     re-running the same command continues a run (a job requeued after a preemption or a failure does exactly this);
  2. otherwise checkpoint.resume (another run's checkpoint: a step directory or a checkpoint root), with
     checkpoint.load_optimizer=false for the weights only (a fresh optimizer, data and schedule from step 0);
  3. otherwise from scratch; an out_dir that holds the metrics of an attempt that committed no checkpoint starts
     afresh with those metrics set aside (megaloop.train.rerun), one that holds a COMPLETED run is refused.
Rank 0's view of the file system decides, so that every rank takes the same branch."""
from __future__ import annotations

from pathlib import Path

from megaloop.config import Config
from megaloop.train.checkpointing.aside import Shelf
from megaloop.train.checkpointing.common import ResumeError
from megaloop.train.protocols import TrainerRuntime


class ResumePolicy:
    """The candidates a run may start from, and the refusal of an out_dir that is not this run's to reuse."""

    def __init__(self, cfg: Config, runtime: TrainerRuntime, root: Path, shelf: Shelf, note):
        self.cfg, self.runtime, self.root, self.shelf, self.note = cfg, runtime, root, shelf, note
        self._own: list[Path] | None = None

    def own(self, before_step: int | None = None) -> list[Path]:
        """This run's committed checkpoints, newest first (`latest` first), as rank 0 sees them: looked up once per
        job, or afresh for `before_step` (only those of earlier steps: a rollback's)."""
        from checkpoints.files import step_of
        from checkpoints.load import find_checkpoints

        if self._own is not None and before_step is None:
            return self._own
        found = [str(p) for p in find_checkpoints(self.root)
                 if before_step is None or (step_of(p.name) or 0) < before_step]
        paths = [Path(p) for p in self.runtime.all_gather_object(found)[0]]
        if before_step is None:
            self._own = paths
        return paths

    def resume_candidates(self, path: Path) -> list[Path]:
        """checkpoint.resume's checkpoints: the directory itself, or a root's committed ones, newest first."""
        from checkpoints.load import find_checkpoints

        if (path / "COMMIT").is_file():
            return [path]
        found = find_checkpoints(path) if path.is_dir() else []
        if not found:
            raise ResumeError(f"checkpoint.resume={str(path)!r} is not a committed checkpoint nor a directory "
                              "holding one: point it at a step_XXXXXXXX directory or at a checkpoint root")
        return found

    def refuse_used_out_dir(self) -> None:
        """A fresh start in an out_dir that holds metrics but no checkpoint: refused when that run COMPLETED (its
        record must stay); otherwise the earlier attempt ended before its first checkpoint (killed, a data error),
        so its metrics are set aside and the run starts afresh, as re-running the same command promises."""
        from megaloop.train.rerun import set_aside_metrics

        out = Path(self.cfg.train.out_dir)
        used, completed, corrupt = self.runtime.all_gather_object(((out / "metrics.jsonl").exists(),
                                                                   (out / "COMPLETED").exists(),
                                                                   self.shelf.unusable()))[0]
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
                self.note(f"{str(out)!r} holds an attempt {why}: starting the run afresh (its metrics are kept "
                          f"as {aside})")
            self.runtime.barrier()  # no rank starts writing before the old metrics are out of the way
