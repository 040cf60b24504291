"""Entry of `python -m megaloop train`: make the runtime, train, print the summary table."""
from __future__ import annotations

import math
import sys

from megaloop.config import Config
from megaloop.config.budget import tokens_per_step

NO_VALIDATION_HINT = ("the shards have no val split (e.g. made with --val-fraction 0); re-create the shards with "
                      "--val-fraction > 0 to measure it")
VALIDATION_OFF_HINT = "validation was off (data.val_batches=0; `megaloop bench` turns it off to time the steps alone)"


def run_training(cfg: Config) -> int:
    from data_prep.errors import DataPrepError
    from megaloop.config import ConfigError
    from megaloop.train.checkpointing import STOP_EXIT_CODE, ResumeError, SaveFailed
    from megaloop.train.loop import TrainingDiverged, train
    from megaloop.train.stopping import StartupStop
    from pipeline.layout import LayoutError

    try:
        check_before_training(cfg)
        summary = train(cfg)
    except KeyboardInterrupt:
        print("megaloop: interrupted; nothing was saved after the last committed checkpoint",
              file=sys.stderr)
        return 130
    except StartupStop as stop:
        print(f"megaloop: stopped by {stop.signal_name} during start-up, before the first step: nothing to save; run "
              f"the same command again to continue from the last committed checkpoint (exit code {STOP_EXIT_CODE})",
              file=sys.stderr)
        return STOP_EXIT_CODE
    except (TrainingDiverged, SaveFailed) as err:
        note_error_for_launcher(err)
        print(f"megaloop: {err}", file=sys.stderr)
        return 1
    except (ConfigError, DataPrepError, ResumeError, FileNotFoundError) as err:
        return report_bad_input(f"megaloop: {err}")
    except LayoutError as err:
        return report_bad_input(f"megaloop: parallel layout error: {err}")
    except Exception as err:  # a bug, a lost peer, a timed-out collective: the traceback follows
        note_error_for_launcher(err)
        raise
    if summary.is_main and not summary.nothing_to_do:  # a job that trained nothing has said so in one line
        print(format_summary(cfg, summary))
    if summary.interrupted:
        if summary.is_main and summary.spike_stop:
            print(f"megaloop: stopped after {summary.steps_done} steps ({summary.stop_reason}) without saving the "
                  f"state after the spike; run the same command again to continue from the checkpoint before it, "
                  f"once the cause is dealt with (exit code {STOP_EXIT_CODE})", file=sys.stderr)
        elif summary.is_main:
            print(f"megaloop: stopped after step {summary.steps_done} ({summary.stop_reason}) and saved a "
                  f"checkpoint; run the same command again to continue (exit code {STOP_EXIT_CODE})", file=sys.stderr)
        return STOP_EXIT_CODE
    return 0


def note_error_for_launcher(err: BaseException) -> None:
    """Under torchrun (TORCHELASTIC_ERROR_FILE set), the error's type and message into the worker's error file: the
    launcher (torchrun's failure table, slurm.agent's failure record) names it as the cause. Call inside `except`."""
    import os

    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        try:
            ErrorHandler().record_exception(err)
        except OSError:
            pass


ERROR_DIR_ENV = "MEGALOOP_ERROR_DIR"  # set by `megaloop launch`: where each rank leaves its bad-input line


def report_bad_input(line: str) -> int:
    """Exit code 2 with one line: on stderr, or, under `megaloop launch`, in the launcher's error folder (one file
    per rank), so that the launcher shows each distinct error once instead of once per rank."""
    import os

    folder = os.environ.get(ERROR_DIR_ENV)
    if folder:
        try:
            with open(os.path.join(folder, f"rank{os.environ.get('RANK', '0')}.txt"), "w") as f:
                f.write(line + "\n")
            return 2
        except OSError:
            pass  # the folder is gone: say it here instead
    print(line, file=sys.stderr)
    return 2


def _validation_set(val: dict) -> str:
    """'  (validation: N rows, M tokens)' from the final validation's records (rows: the fixed set every layout
    validates on; `megaloop eval` with its defaults scores the same)."""
    first = next((v for v in val.values() if v.get("tokens")), None)
    if first is None:
        return ""
    rows = f"{first['rows']:,} rows, " if "rows" in first else ""
    return f"  (validation: {rows}{first['tokens']:,} tokens)"


def format_summary(cfg: Config, s) -> str:
    def tf(flops):
        return flops / s.train_time_s / 1e12 if s.train_time_s else float("nan")

    job = (f"; this job: {s.steps_done - s.start_step} steps from step {s.start_step}, {s.job_tokens:,} tokens"
           if s.start_step else "")  # the run's figures count the resumed steps; tokens/s is this job's
    lines = [
        "",
        f"megaloop run: {cfg.train.out_dir}  ({s.steps_done} of {cfg.train.steps:,} steps"
        f"{', interrupted' if s.interrupted else ''}, {s.n_params / 1e6:.2f}M params, {s.tokens:,} of "
        f"{cfg.train.steps * tokens_per_step(cfg):,} tokens, {s.skipped} skipped steps{job})",
        f"{'T':>4} {'val loss':>9} {'val bpb':>8}{_validation_set(s.val)}",
    ]
    if s.val and not any(v["tokens"] for v in s.val.values()):
        hint = VALIDATION_OFF_HINT if cfg.data.val_batches == 0 else NO_VALIDATION_HINT
        lines.append(f"{'all':>4} {'n/a':>9} {'n/a':>8}  (no validation tokens: {hint})")
    for depth, v in sorted(s.val.items()) if any(v["tokens"] for v in s.val.values()) else ():
        loss = "n/a" if not math.isfinite(v["val_loss"]) else f"{v['val_loss']:.4f}"
        bpb = "n/a" if not math.isfinite(v["val_bpb"]) else f"{v['val_bpb']:.3f}"
        lines.append(f"{depth:>4} {loss:>9} {bpb:>8}")
    lines += [
        f"precision             {s.precision} ({s.precision_why})",
        f"tokens/s              {s.tokens_per_s:,.0f}",
        f"useful TFLOP/s        {tf(s.useful_flops):.4f}",
        f"executed TFLOP/s      {tf(s.executed_flops):.4f}",
        f"peak TFLOP/s          {s.peak_tflops:.4f} ({s.peak_source})",
        f"MFU (useful/peak)     {format_mfu(tf(s.useful_flops), tf(s.executed_flops), s)}",
        f"data                  {format_data(s)}",
    ]
    return "\n".join(lines)


def format_data(s) -> str:
    """The loader's figures of this job (rank 0's): its wait for batches, shard downloads, the node cache's hits."""
    wait = s.data_wait_s
    share = f" ({100 * wait / s.train_time_s:.1f}% of the train time)" if s.train_time_s else ""
    skipped = s.data_shards_skipped
    return (f"{wait:.2f} s waiting for batches{share}, {s.data_bytes_downloaded / 1e6:.1f} MB of shards "
            f"downloaded, node cache hit ratio {s.data_cache_hit_ratio:.2f}"
            + (f", {skipped} corrupt shard(s) skipped" if skipped else ""))


def format_mfu(useful_tflops: float, executed_tflops: float, s) -> str:
    """The run's MFU in percent, or why there is none: never a figure above 100%, since a rate above the peak
    means the peak was measured low (the CPU was busy then)."""
    peak = s.peak_tflops
    if not math.isfinite(peak) or not math.isfinite(useful_tflops):
        return "n/a"
    if executed_tflops > peak or s.peak_unreliable_steps:
        import torch

        command = (f"python -m megaloop peak --refresh --precision {s.precision} --threads "
                   f"{torch.get_num_threads()}")
        return (f"n/a (unreliable: {s.peak_unreliable_steps} steps ran faster than the peak, which was measured "
                f"while the CPU was busy; re-measure it on an idle machine: {command})")
    return f"{100 * useful_tflops / peak:.1f}%"


def check_before_training(cfg: Config) -> None:
    """What the config cannot say about this machine, checked before anything is built: the device exists and
    train.out_dir can be a directory that this process may write."""
    import os
    from pathlib import Path

    import torch

    from megaloop.config import ConfigError

    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device", cfg.train.device, "no CUDA device is available on this machine; use "
                          "train.device=cpu, or auto (a GPU when there is one, else the CPU)")
    from megaloop.model.attention import AttentionBackendError, resolve_attention_backend

    device = "cuda" if cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available()) \
        else "cpu"
    try:  # looked up once per process: the build reuses it
        resolve_attention_backend(cfg.model.attention, device)
    except AttentionBackendError as err:
        raise ConfigError("model.attention", cfg.model.attention, str(err)) from None
    out = Path(cfg.train.out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError("train.out_dir", cfg.train.out_dir, "is a file, not a directory; choose another "
                          "train.out_dir")
    existing = next(p for p in (out, *out.absolute().parents) if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError("train.out_dir", cfg.train.out_dir, f"cannot be created or written ({existing} is "
                          f"{'not a directory' if not existing.is_dir() else 'not writable'}); choose a writable "
                          "train.out_dir")
