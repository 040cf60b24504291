"""metrics.jsonl (one JSON object per line) and TensorBoard event files, with the documented schema.

Seven record kinds share the file: "train" (one per optimizer step), "val" (one per validation depth T),
"resume" (a job continued the run from a checkpoint: the records of later steps that an earlier job may have
written before it stopped are superseded by those after this line) and "checkpoint_failed" (the save of `step` was
not committed; `fatal`: it ended the run, see megaloop.train.checkpointing.RunCheckpoints.wait) and "spike" (a
loss spike, with rho(A) and ||h_T|| at that step and the action train.on_spike took; megaloop.train.spikes),
"restart" (an attempt that resumed after a failure; megaloop.train.restarts) and "rollback" (train.on_spike=rollback
restored a checkpoint and skipped batches).
SCHEMA below is the contract that tests validate and the README documents.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

NUMBER = (int, float)

TRAIN_FIELDS = {
    "kind": str, "step": int, "loss": NUMBER, "lr": NUMBER, "grad_norm": NUMBER, "skipped": bool,
    "skipped_total": int, "tokens": int, "tokens_per_s": NUMBER, "rho_A": NUMBER, "state_norm": NUMBER,
    "recurrent_residual": NUMBER, "mean_depth": NUMBER, "executed_depth": NUMBER, "idle_fraction": NUMBER,
    "idle_fraction_loop": NUMBER, "useful_flops": NUMBER,
    "executed_flops": NUMBER, "mfu": NUMBER, "hfu": NUMBER, "time_data": NUMBER, "time_forward": NUMBER,
    "time_backward": NUMBER, "time_optimizer": NUMBER, "time_communication": NUMBER, "time_pipeline_idle": NUMBER,
    "time_phases_step": int,  # the step the forward ... pipeline_idle times are of (on a GPU: the one before)
    "time_step": NUMBER,
    "data_bytes_downloaded": int, "data_cache_hit_ratio": NUMBER,  # this rank's node-cache figures so far
    "gpu_max_allocated": NUMBER, "gpu_max_reserved": NUMBER,  # this rank's CUDA allocator peaks so far (NaN: CPU)
    "epoch": int,  # the epoch of the step's last sample (0-based: 1 once the corpus has wrapped)
}
VAL_FIELDS = {"kind": str, "step": int, "T": int, "val_loss": NUMBER, "val_bpb": NUMBER, "tokens": int,
              "rows": int}
# a job continued the run from a checkpoint at `step`; the bytes the resume read from it (verification and load) over
# all ranks and on the rank that read most (megaloop.train.resume_io)
RESUME_FIELDS = {"kind": str, "step": int, "from": str, "bytes_read": int, "bytes_read_max_rank": int}
CHECKPOINT_FAILED_FIELDS = {"kind": str, "step": int, "error": str, "in_a_row": int, "fatal": bool}
SPIKE_FIELDS = {"kind": str, "step": int, "loss": NUMBER, "median": NUMBER, "mad": NUMBER, "threshold": NUMBER,
                "rho_A": NUMBER, "state_norm": NUMBER, "action": str}  # a loss spike (megaloop.train.spikes)
# a job attempt that resumed after a failure (a rank died or hung): what failed, where, and what it cost; `step` is
# the step the attempt resumed from, `rank` -1 and `node` "" when no rank could be named
RESTART_FIELDS = {"kind": str, "step": int, "attempt": int, "cause": str, "rank": int, "node": str,
                  "steps_lost": int, "time_lost_s": NUMBER}
# train.on_spike=rollback: the spike at `step`, the checkpoint restored, the global batches skipped (a window ending
# at the spike) and their run-wide sample indices as [start, stop) ranges, the rollbacks so far
ROLLBACK_FIELDS = {"kind": str, "step": int, "restored_step": int, "skipped_batches": list, "skipped_samples": list,
                   "rollbacks": int}
SCHEMA = {"train": TRAIN_FIELDS, "val": VAL_FIELDS, "resume": RESUME_FIELDS,
          "checkpoint_failed": CHECKPOINT_FAILED_FIELDS, "spike": SPIKE_FIELDS, "restart": RESTART_FIELDS,
          "rollback": ROLLBACK_FIELDS}


def validate_record(record: dict) -> None:
    """Raise ValueError if a metrics record does not follow SCHEMA (missing field, wrong type)."""
    kind = record.get("kind")
    if kind not in SCHEMA:
        raise ValueError(f"record kind {kind!r} is not one of {sorted(SCHEMA)}")
    for name, tp in SCHEMA[kind].items():
        if name not in record:
            raise ValueError(f"{kind} record lacks {name!r}: {record}")
        value = record[name]
        if tp is NUMBER and isinstance(value, bool) or not isinstance(value, tp):
            raise ValueError(f"{kind} record field {name!r}={value!r} is not {tp}")


class MetricsWriter:
    """Appends records to <out_dir>/metrics.jsonl and mirrors numbers to TensorBoard (<out_dir>/tb) and, given an
    open W&B run (train.wandb; megaloop.train.wandb_log.WandbLog), every record to it."""

    def __init__(self, out_dir: Path, enabled: bool = True, tensorboard: bool = True, wandb=None):
        self.enabled = enabled
        self.path = Path(out_dir) / "metrics.jsonl"
        self._file = None
        self._tb = None
        self._wandb = wandb if enabled else None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", buffering=1)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(Path(out_dir) / "tb"))

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        validate_record(record)
        self._file.write(json.dumps(record) + "\n")
        if self._tb is not None:
            self._mirror(record)
        if self._wandb is not None:
            self._wandb.log(record)

    def _mirror(self, record: dict) -> None:
        step = record["step"]
        if record["kind"] == "resume":
            return
        if record["kind"] == "spike":
            self._tb.add_scalar("spike/loss", record["loss"], step)
            return
        if record["kind"] == "restart":
            self._tb.add_scalar("restart/steps_lost", record["steps_lost"], step)
            self._tb.add_scalar("restart/time_lost_s", record["time_lost_s"], step)
            return
        if record["kind"] == "val":
            self._tb.add_scalar(f"val/loss_T{record['T']}", record["val_loss"], step)
            return
        for key, value in record.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                self._tb.add_scalar(f"train/{key}", value, step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None
        if self._wandb is not None:  # called from a `finally`: an error on its way out marks the W&B run failed
            self._wandb.finish(failed=sys.exc_info()[1] is not None)
            self._wandb = None


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def read_json_lines(path: Path) -> list[dict]:
    """The JSON objects of a file that several processes append to and a crash may cut short (metrics.jsonl,
    failures.jsonl, heartbeats): a torn or foreign line is left out; [] when the file cannot be read."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return []
    found = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            found.append(record)
    return found
