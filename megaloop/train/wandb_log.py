"""train.wandb: rank 0 mirrors the metrics records (metrics.jsonl, megaloop.train.metrics) to a Weights & Biases run.

One W&B run per train.out_dir. Its id is kept in <out_dir>/wandb/run_id, so a job that resumes the run (the same
command re-run in the same out_dir) continues the same W&B run (wandb.init(id=..., resume="allow")); wandb writes its
own files under <out_dir>/wandb too. The run's config is the resolved megaloop config.

The x axis of every W&B metric is the record's own `step` (define_metric), not wandb's internal step counter: a
resumed job logs again the steps that an earlier job logged after its last checkpoint (metrics.jsonl's "resume" line
supersedes them the same way), and a rollback goes back in steps, both of which a monotonic counter would drop.

wandb is imported here only, and only when train.wandb is set (the config refuses train.wandb where it is not
installed: megaloop.config.sections.check_wandb). WANDB_MODE=offline writes the run without a network;
`wandb sync <out_dir>/wandb/offline-run-*` uploads it later (the jobs of one run in order, as one W&B run).
"""
from __future__ import annotations

import math
import os
import secrets
import string
import sys
from pathlib import Path

WANDB_DIR = "wandb"  # under train.out_dir: wandb's run folders and RUN_ID_FILE
RUN_ID_FILE = "run_id"
STEP_KEY = "step"  # the W&B x axis: the record's optimizer step
ID_CHARS = string.ascii_lowercase + string.digits


def split_target(target: str) -> tuple[str | None, str]:
    """train.wandb as (entity, project): "project" (entity: wandb's default) or "entity/project"."""
    entity, _, project = target.rpartition("/")
    return entity or None, project


def run_id_path(out_dir: Path) -> Path:
    return Path(out_dir) / WANDB_DIR / RUN_ID_FILE


def new_run_id() -> str:
    """A fresh W&B run id: 8 random lowercase letters and digits (the form wandb gives its own)."""
    return "".join(secrets.choice(ID_CHARS) for _ in range(8))


def run_id(out_dir: Path) -> str:
    """The W&B run id of this out_dir: the stored one, else a new one stored now. The file is written whole (a
    rename), so that a crash leaves either no id or the complete one."""
    path = run_id_path(out_dir)
    stored = path.read_text().strip() if path.is_file() else ""
    if stored:
        return stored
    path.parent.mkdir(parents=True, exist_ok=True)
    fresh = new_run_id()
    tmp = path.with_name(f"{RUN_ID_FILE}.tmp")
    tmp.write_text(fresh + "\n")
    os.replace(tmp, path)
    return fresh


def wandb_values(record: dict) -> dict:
    """A metrics record as one W&B row: `step`, and <kind>/<field> for its numbers (booleans as 0/1) and texts; a
    validation record as val/loss_T<T> and val/bpb_T<T> (TensorBoard's names). Non-finite numbers (an MFU that could
    not be measured) and lists (a rollback's batches) are left out, as TensorBoard leaves them out."""
    kind = record["kind"]
    if kind == "val":
        fields = {f"loss_T{record['T']}": record["val_loss"], f"bpb_T{record['T']}": record["val_bpb"]}
    else:
        fields = {k: v for k, v in record.items() if k not in ("kind", STEP_KEY)}
    values = {STEP_KEY: record[STEP_KEY]}
    for key, value in fields.items():
        value = int(value) if isinstance(value, bool) else value
        if isinstance(value, float) and not math.isfinite(value):
            continue
        if isinstance(value, (int, float, str)):
            values[f"{kind}/{key}"] = value
    return values


class WandbLog:
    """An open W&B run that takes each metrics record MetricsWriter writes."""

    def __init__(self, run):
        self.run = run

    def log(self, record: dict) -> None:
        self.run.log(wandb_values(record))

    def finish(self, failed: bool = False) -> None:
        """End this job's part of the run (exit code 1 when the job is failing: W&B marks the run crashed)."""
        if self.run is not None:
            self.run.finish(exit_code=1 if failed else 0)
            self.run = None


def open_wandb(cfg, out_dir: Path) -> WandbLog | None:
    """Rank 0's W&B run for cfg.train.wandb (None when it is empty), continuing the out_dir's run if it has one.
    A run that cannot be opened (no network to W&B, no login) is a warning, not the end of the training: every
    record stays in metrics.jsonl."""
    if not cfg.train.wandb:
        return None
    import wandb

    entity, project = split_target(cfg.train.wandb)
    rid = run_id(out_dir)
    try:
        run = wandb.init(project=project, entity=entity, id=rid, resume="allow", dir=str(out_dir),
                         name=os.environ.get("WANDB_NAME") or Path(out_dir).resolve().name, config=cfg.to_dict())
    except Exception as err:  # wandb raises its own errors (CommError, UsageError, ...) and plain ones
        print(f"megaloop: warning: train.wandb={cfg.train.wandb}: the W&B run {rid} could not be opened "
              f"({type(err).__name__}: {err}); training goes on without W&B (every record is in metrics.jsonl; "
              "WANDB_MODE=offline logs without a network)", file=sys.stderr, flush=True)
        return None
    run.define_metric(STEP_KEY)
    run.define_metric("*", step_metric=STEP_KEY)
    print(f"megaloop: W&B run {rid} in project {cfg.train.wandb} ({wandb_mode(run)}; wandb files in "
          f"{Path(out_dir) / WANDB_DIR})", file=sys.stderr, flush=True)
    return WandbLog(run)


def wandb_mode(run) -> str:
    """offline (written locally, to be synced) or online (streamed to W&B), as the run was opened."""
    return "offline" if run.offline else "online"
