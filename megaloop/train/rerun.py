"""Re-running a run's command: when there is nothing left to do, and when an earlier attempt left no checkpoint.

A run is its out_dir: re-running the same command must never cost the run its record. With nothing left to do
(the newest checkpoint is at train.steps or beyond) no file of the run is written, not even the config (a re-run
with a smaller train.steps would otherwise replace the finished run's config and summary). An attempt that ended
before its first checkpoint (killed, or a data error at step 0) left metrics but nothing to continue from: the next
attempt starts afresh and keeps the earlier metrics beside the new ones under another name. A run resumed with a
larger train.steps than its schedule spans is extended as train.extend says (:func:`schedule_horizon`).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from megaloop.config import Config
from megaloop.train.protocols import TrainerRuntime

SET_ASIDE = ("metrics.jsonl", "tb")  # what a fresh start would otherwise append to


def recorded_summary(cfg: Config, runtime: TrainerRuntime, step: int, tokens: int):
    """The summary of a run that is already at `step` >= train.steps, written nowhere: this job trained nothing;
    the final validation is the one the run's summary.json recorded at that step, if any."""
    from megaloop.model import build_model, count_parameters
    from megaloop.train.loop import RunSummary

    if runtime.is_main:
        print(f"megaloop: nothing to do: the run is at step {step} of train.steps={cfg.train.steps} (raise "
              "train.steps to train further); no file of the run was changed", file=sys.stderr, flush=True)
    summary = RunSummary(steps_done=step, start_step=step, tokens=tokens, is_main=runtime.is_main,
                         n_params=count_parameters(build_model(cfg.model, device="meta")), nothing_to_do=True)
    recorded = Path(cfg.train.out_dir) / "summary.json"
    try:
        saved = json.loads(recorded.read_text())
    except (OSError, ValueError):
        return summary
    if saved.get("steps_done") == step and isinstance(saved.get("val"), dict):
        summary.val = {int(depth): v for depth, v in saved["val"].items()}
    return summary


def set_aside_metrics(out_dir: Path) -> str:
    """Rename the metrics of an attempt that left no checkpoint to metrics.<n>.jsonl (and tb to tb.<n>), n the
    first number free for both; returns the new name of metrics.jsonl."""
    n = 1
    while any((out_dir / _numbered(name, n)).exists() for name in SET_ASIDE):
        n += 1
    for name in SET_ASIDE:
        if (out_dir / name).exists():
            (out_dir / name).rename(out_dir / _numbered(name, n))
    return _numbered("metrics.jsonl", n)


def _numbered(name: str, n: int) -> str:
    stem, dot, suffix = name.partition(".")
    return f"{stem}.{n}.{suffix}" if dot else f"{name}.{n}"


def schedule_horizon(meta: dict, cfg: Config, step: int, note) -> int:
    """The steps the learning-rate schedule of a run resumed from checkpoint metadata `meta` (at `step`) spans.

    The checkpoint records the horizon its run's schedule had ("schedule_steps"; older checkpoints: the saving
    job's train.steps, which was their horizon). Up to it, train.steps decides, as in any run (a shorter run cools
    down sooner). Beyond it, train.extend=continue keeps the recorded horizon, so steps already trained keep their
    rates and the extension runs at the last one (the decayed rate, never back up); rewarm spans the schedule over
    the new train.steps, which restarts the cool-down from a higher rate when the run had cooled down already."""
    saved = int(meta.get("schedule_steps") or meta.get("config", {}).get("train", {}).get("steps") or 0)
    steps = cfg.train.steps
    if not saved or steps <= saved:
        return steps
    if cfg.train.extend == "continue":
        first = max(saved, step)  # the steps this job runs beyond the horizon (earlier extensions ran the others)
        done = f", as steps {saved}..{step - 1} did" if step > saved else ""
        note(f"train.steps={steps} extends a run whose schedule spans {saved} steps: train.extend=continue keeps "
             f"it, steps {first}..{steps - 1} run at the rate of step {saved - 1}{done} (train.extend=rewarm spans "
             f"the schedule over {steps} steps instead)")
        return saved
    note(f"train.steps={steps} extends a run whose schedule spans {saved} steps: train.extend=rewarm spans it over "
         f"{steps} steps (from step {step} the learning rate follows that schedule, higher if the run had cooled down)")
    return steps
