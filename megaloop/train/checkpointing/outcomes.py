"""What happens when a save fails (the failure policy), and the save figures the job agrees on.

A failed periodic save lets training go on (the previous checkpoint is still committed and the next save tries
again: a transient file-system error must not end a job of hundreds of GPUs), but MAX_FAILED_SAVES in a row raise
SaveFailed: the storage is broken and the job would train on with nothing to resume from. A save that must land
(the final or stop save) raises SaveFailed on any failure. Every rank agrees (one reduction), since ranks other
than 0 only see their own part of a save."""
from __future__ import annotations

import sys
from pathlib import Path

from megaloop.train.checkpointing.common import SaveFailed
from megaloop.train.protocols import TrainerRuntime

MAX_FAILED_SAVES = 2  # periodic saves failing in a row that stop the run


class SaveOutcomes:
    """The outcomes of one job's saves: the failures in a row, and each rank's (step, training stall s, background
    write s) with the job's slowest stall and write (the same on every rank: checkpoint cadence, time budget)."""

    def __init__(self, runtime: TrainerRuntime, root: Path):
        self.runtime, self.root = runtime, root
        self.failed_in_a_row = 0
        self.saved: list[tuple[int, float, float]] = []
        self.slowest_stall_s = self.slowest_write_s = 0.0
        self.record = lambda record: None  # the run's metrics writer (set by the loop once it exists)

    def settle(self, results: list, must_land: bool, agree: bool) -> None:
        """Take the results of the saves that finished: report a failure as a line and a "checkpoint_failed"
        record, and raise SaveFailed where the policy says so (only with agreement: agree=False, closing while an
        error may be unwinding on some ranks only, reports and never raises)."""
        errors = [r for r in results if not r.ok]
        self.saved += [(r.step, r.stall_s, r.write_s) for r in results if r.ok]
        if agree and self.saved:
            self.slowest_stall_s = self.runtime.world_max(max(stall for _, stall, _ in self.saved))
            self.slowest_write_s = self.runtime.world_max(max(write for _, _, write in self.saved))
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
