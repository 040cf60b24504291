"""A data-parallel checkpoint saved, resumed and compared: one run of 3 steps saving at step 2 and at its end, and
a second run resumed from its step-2 checkpoint in another folder (checkpoint.resume) to step 3. Both final
checkpoints and the loss of step 3 must be identical bit for bit on CPU; on GPU they agree within bf16's
tolerance (bf16 kernels such as the embedding's and attention's backward accumulate in a nondeterministic order)."""
from __future__ import annotations

import time
from pathlib import Path

from megaloop.preflight.bandwidth import bus_bandwidth, expected_rate
from megaloop.preflight.context import Context
from megaloop.preflight.paths_train import agree, compare_runs, numel, overrides, run_parallel
from megaloop.preflight.report import PathResult

STEPS, SAVED_AT = 3, 2


def saved_at(root: Path, step: int) -> Path:
    """The committed checkpoint of `step` under the run's checkpoint root."""
    from checkpoints.load import CheckpointReader, find_checkpoints

    for path in find_checkpoints(root / "checkpoints"):
        if CheckpointReader(path).step == step:
            return path
    raise RuntimeError(f"the run in {root} left no committed checkpoint of step {step}")


def checkpoint_dp(ctx: Context) -> PathResult:
    """dp = world: save, resume in another run, compare with the run that went on (bitwise on CPU)."""
    start = time.perf_counter()
    root = ctx.work_dir / "checkpoint_dp"
    whole, _ = run_parallel(ctx, overrides(ctx, root / "whole", steps=STEPS, extra=[f"checkpoint.every={SAVED_AT}"]))
    resume = saved_at(root / "whole", SAVED_AT)
    extra = [f"checkpoint.resume={resume}"] + (["optim.matrix_lr=0.0201"] if ctx.faulty("checkpoint_dp") else [])
    resumed, runtime = run_parallel(ctx, overrides(ctx, root / "resumed", steps=STEPS, extra=extra))
    verdict = [None, None]
    if ctx.is_main:
        ok, detail = compare_runs(resumed.losses, whole.losses[SAVED_AT:], root / "resumed", root / "whole",
                                  ctx.loss_tol, ctx.param_tol, bitwise=not ctx.on_gpu, prefix=ctx.compared_arrays)
        if resumed.start_step != SAVED_AT:
            ok, detail = False, f"the resumed run started at step {resumed.start_step}, not {SAVED_AT}; {detail}"
        verdict = [ok, f"dp{ctx.world}: resumed at step {SAVED_AT} of {STEPS}, {detail}"]
    ok, detail = agree(verdict)
    layout = runtime.layout
    bw = bus_bandwidth("all_gather", layout.dp_group, numel(ctx), ctx.device) if layout.dp_group else None
    expected, link = expected_rate(ctx.device, ctx.spans_nodes(layout.dp_ranks))
    return PathResult("checkpoint_dp", ok, f"{detail}; all_gather over the dp group", time.perf_counter() - start,
                      bw, expected, link)
