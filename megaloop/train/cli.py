"""Entry of `python -m megaloop train`: make the runtime, train, print the summary table."""
from __future__ import annotations

import math
import sys

from megaloop.config import Config


def run_training(cfg: Config) -> int:
    from data_prep.errors import DataPrepError
    from megaloop.config import ConfigError
    from megaloop.train.loop import train
    from pipeline.layout import LayoutError

    try:
        summary = train(cfg)
    except (ConfigError, DataPrepError, FileNotFoundError) as err:
        print(f"megaloop: {err}", file=sys.stderr)
        return 2
    except LayoutError as err:
        print(f"megaloop: parallel layout error: {err}", file=sys.stderr)
        return 2
    if summary.is_main:
        print(format_summary(cfg, summary))
    return 130 if summary.interrupted else 0


def format_summary(cfg: Config, s) -> str:
    def tf(flops):
        return flops / s.train_time_s / 1e12 if s.train_time_s else float("nan")

    lines = [
        "",
        f"megaloop run: {cfg.train.out_dir}  ({s.steps_done} steps{', interrupted' if s.interrupted else ''}, "
        f"{s.n_params / 1e6:.2f}M params, {s.tokens:,} tokens, {s.skipped} skipped steps)",
        f"{'T':>4} {'val loss':>9} {'val bpb':>8}",
    ]
    for depth, v in sorted(s.val.items()):
        bpb = "n/a" if not math.isfinite(v["val_bpb"]) else f"{v['val_bpb']:.3f}"
        lines.append(f"{depth:>4} {v['val_loss']:>9.4f} {bpb:>8}")
    peak = s.peak_tflops
    lines += [
        f"tokens/s              {s.tokens_per_s:,.0f}",
        f"useful TFLOP/s        {tf(s.useful_flops):.4f}",
        f"executed TFLOP/s      {tf(s.executed_flops):.4f}",
        f"peak TFLOP/s          {peak:.3f} ({s.peak_source})",
        f"MFU (useful/peak)     {100 * tf(s.useful_flops) / peak:.1f}%" if math.isfinite(peak) else "MFU n/a",
    ]
    return "\n".join(lines)
