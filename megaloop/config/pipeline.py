"""Checks of a pipeline-parallel layout (parallel.pp > 1) against the model, the batch sizes and the engine.

The ring pipeline (pipeline/ring) cuts the core blocks into pp consecutive stages, one per ring rank, and runs one
optimizer step's micro-batches around the ring. What it needs:

- every stage holds at least one core block: pp <= model.n_core;
- at least pp micro-batches per step on each data-parallel rank: a micro-batch is on one rank at a time, so with
  m < pp micro-batches at most m of the pp ranks compute at once whatever the schedule (the generator still makes
  a deadlock-free schedule for any m >= 1, but one that leaves at least 1 - m/pp of the ring idle);
- the native engine: DeepSpeed runs data parallelism only here.
"""
from __future__ import annotations

from megaloop.config.errors import ConfigError


def check_pipeline(pp: int, n_core: int, engine: str, global_batch: int, micro_batch: int, dp: int) -> None:
    """Raise ConfigError for a pp > 1 layout the ring pipeline cannot run well (see the module docstring); dp: the
    data-parallel size (1 when the world size is unknown: the most micro-batches per rank any job can have)."""
    if pp == 1:
        return
    if engine != "native":
        raise ConfigError("parallel.pp", pp, f"parallel.engine={engine} cannot run it: DeepSpeed runs data "
                          "parallelism only here; use parallel.engine=native for the ring pipeline (or parallel.pp=1)")
    if pp > n_core:
        raise ConfigError("parallel.pp", pp, f"the core has {n_core} blocks: use parallel.pp <= {n_core} (each "
                          "stage holds at least one core block)")
    micro_batches, uneven = divmod(global_batch, micro_batch * dp)
    if micro_batches < pp and not uneven:  # an uneven split is the batch-size check's to report
        raise ConfigError("parallel.pp", pp, _too_few_micro_batches(pp, global_batch, micro_batch, dp,
                                                                    micro_batches))


def _too_few_micro_batches(pp: int, global_batch: int, micro_batch: int, dp: int, micro_batches: int) -> str:
    """The message for m < pp, with the data.* values that give m >= pp."""
    rows = global_batch // dp
    fits = [b for b in range(rows // pp, 0, -1) if rows % b == 0]
    fixes = [f"data.micro_batch_size={fits[0]}"] if fits else []
    fixes.append(f"data.global_batch_size={pp * micro_batch * dp}")
    return (f"the ring pipeline needs at least pp={pp} micro-batches per step on each data-parallel rank, but "
            f"data.global_batch_size={global_batch} / (data.micro_batch_size={micro_batch} x dp={dp}) gives "
            f"{micro_batches} (with fewer micro-batches than stages at most {micro_batches} of the {pp} ranks "
            f"compute at once); use {' or '.join(fixes)}, or a smaller parallel.pp")
