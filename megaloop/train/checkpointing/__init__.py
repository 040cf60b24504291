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

The parts: common (exit code, errors, where checkpoints live), state (the arrays and the full load), verify (which
checkpoint loads), aside (setting checkpoints aside), resume (where a run starts), outcomes (the failure policy of
saves), markers (STOPPED / COMPLETED for batch scripts), and run (RunCheckpoints, which a training job drives).
"""
from megaloop.train.checkpointing.common import (METADATA_VERSION, STOP_EXIT_CODE, ResumeError, SaveFailed,
                                                checkpoint_root)
from megaloop.train.checkpointing.markers import MARKERS, mark_startup_stop
from megaloop.train.checkpointing.outcomes import MAX_FAILED_SAVES
from megaloop.train.checkpointing.state import (ShardReader, config_differences, load_model, make_reader_fn,
                                               state_pieces, weights_fit)
from megaloop.train.checkpointing.verify import verify_share
from megaloop.train.checkpointing.run import RunCheckpoints

__all__ = ["MARKERS", "MAX_FAILED_SAVES", "METADATA_VERSION", "STOP_EXIT_CODE", "ResumeError", "RunCheckpoints",
           "SaveFailed", "ShardReader", "checkpoint_root", "config_differences", "load_model", "make_reader_fn",
           "mark_startup_stop", "state_pieces", "verify_share", "weights_fit"]
