"""train.fp8 in the trainer: which layers run in FP8, on which backend, converted right after the split.

The core's linear layers (the looped blocks) always, the prelude's and coda's with train.fp8_prelude_coda; the
embeddings, value embeddings, head, injection and C never (they are not block linear layers). The conversion runs on
each rank after its tensor-parallel split and materialisation (pipeline/fp8.py; Transformer Engine:
pipeline/te_backend.py), so the parameters, their names and the checkpoints are those of a run without FP8.
"""
from __future__ import annotations

import sys

CORE = ("core.*",)
OUTER = ("prelude.*", "coda.*")


def fp8_patterns(train_cfg) -> tuple[str, ...]:
    """The module-name patterns of the layers train.fp8 converts."""
    return CORE + (OUTER if train_cfg.fp8_prelude_coda else ())


def convert_model(model, train_cfg, tp_group=None):
    """Convert `model`'s selected layers by train.fp8 / train.fp8_backend (in place); returns the report."""
    if train_cfg.fp8_backend == "te":
        from pipeline.te_backend import convert_to_te

        return convert_to_te(model, fp8_patterns(train_cfg), tp_group)
    from pipeline.fp8 import convert_to_float8

    return convert_to_float8(model, train_cfg.fp8, fp8_patterns(train_cfg), tp_group, train_cfg.fp8_scale_rounding)


def with_fp8(fill, train_cfg, runtime):
    """The materialiser `fill(model, tp_info)` followed by the FP8 conversion (unchanged for train.fp8=none); the
    main rank prints what was converted and what was skipped."""
    if train_cfg.fp8 == "none":
        return fill
    if train_cfg.fp8_backend == "te":
        from pipeline.te_backend import require_te

        require_te()  # a one-line error before anything is built where TE cannot run

    def fill_then_convert(model, tp_info) -> None:
        fill(model, tp_info)
        layout = runtime.layout
        group = layout.tp_group if layout is not None and layout.tp > 1 else None
        report = convert_model(model, train_cfg, group)
        if runtime.is_main:
            print(f"megaloop: {report.summary()}", file=sys.stderr, flush=True)

    return fill_then_convert
