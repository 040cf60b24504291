"""The interfaces the trainer drives, written down: what megaloop/train calls on a runtime and on its data.

Several parts implement them. TrainerRuntime: SingleProcessRuntime (megaloop/train/runtime.py) and pipeline's
ParallelRuntime, PipelineRuntime and DeepSpeedRuntime, which satisfy it structurally (pipeline never imports
megaloop). DataSource: ShardData (megaloop/train/data.py). Every implementation provides every member, so the trainer
calls them without probing for capabilities; tests/train/test_protocols.py checks each class against these lists,
and that the lists are exactly what megaloop/train uses.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

if TYPE_CHECKING:
    import torch


class TrainerRuntime(Protocol):
    """The parallel layout as the training loop sees it, so that the loop itself holds no parallel code."""

    # ---- where this process sits ---------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's global rank (checkpoint writers and verifiers are dealt by it)."""

    @property
    def world_size(self) -> int:
        """Processes in the job (the job's peak is this many devices' peak)."""

    @property
    def dp_rank(self) -> int:
        """This process's data-parallel rank: which rows of each global batch it reads."""

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: how many ways each global batch is dealt."""

    @property
    def tp_rank(self) -> int:
        """This process's tensor-parallel rank: which piece of a split parameter it saves and loads."""

    @property
    def tp_size(self) -> int:
        """Tensor-parallel ranks (they hold identical statistics, so the job-wide sums are divided by it)."""

    @property
    def pp_size(self) -> int:
        """Pipeline stages (they count the same host sums, so the job-wide sums are divided by it too)."""

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that prints and writes the run's files."""

    @property
    def device(self) -> torch.device:
        """Where this process computes: batches and statistics go there."""

    @property
    def layout(self) -> Any:
        """The process groups (a pipeline.layout.ParallelLayout), or None in a single process: the data reader and
        the phase timeouts need them."""

    # ---- model and optimizer ---------------------------------------------------------------------------------
    def held_parameter_names(self, model: torch.nn.Module) -> list[str]:
        """The parameters this rank holds (its pipeline stage's): the only ones a split build materialises."""

    def prepare_model(self, model: torch.nn.Module, materialize: Callable | None = None) -> torch.nn.Module:
        """The model as this runtime runs it (split, wrapped); materialize(model, tp_info), when given, fills what
        this rank holds right after the split, so no rank allocates a whole split model."""

    def optimizer_parts(self) -> Any:
        """The distributed inner optimizers and gradient buffer to build the optimizer with (None: plain ones)."""

    def prepare_optimizer(self, optimizer: Any) -> Any:
        """The optimizer the steps call (checked against, or handed to, the runtime's engine)."""

    # ---- one step ----------------------------------------------------------------------------------------------
    @property
    def plans_ahead(self) -> bool:
        """Whether plan_ahead does work: only then does the loader's prefetch thread plan each step for it."""

    def plan_ahead(self, model: torch.nn.Module, micro_batches: list) -> None:
        """Prepare a coming step's schedule from its host micro-batches, off the step's critical path."""

    def run_micro_batches(self, model: torch.nn.Module, micro_batches: list, scales: list[float],
                          autocast: Callable = ..., timer: Any = None) -> list:
        """Forward and backward of the step's micro-batches, each loss times its scale; one result per micro-batch."""

    def reduce_gradients(self, model: torch.nn.Module) -> None:
        """After the last backward: the gradients summed over the replicas, ready for the optimizer step."""

    def finish_param_gather(self) -> None:
        """Wait for a parameter all-gather still in flight, before parameters are read outside a forward."""

    def forward_losses(self, model: torch.nn.Module, micro_batches: list, autocast: Callable = ...) -> list[float]:
        """Each micro-batch's mean token loss without backward (validation)."""

    # ---- collectives -------------------------------------------------------------------------------------------
    def sum_over_dp(self, value: float) -> float:
        """`value` summed over the data-parallel replicas (validation losses and token counts)."""

    def sum_stats(self, values: torch.Tensor) -> torch.Tensor:
        """A step's packed statistics summed over the whole job in one collective, back on the CPU."""

    def world_max(self, value: float) -> float:
        """The maximum over every rank (a save that failed anywhere failed everywhere)."""

    def all_gather_object(self, obj: Any) -> list:
        """Every rank's small picklable `obj`, in rank order (ranks agree on checkpoints and errors)."""

    def gather_object(self, obj: Any, dst: int = 0) -> list | None:
        """Every rank's `obj` on rank `dst`, None elsewhere (rank 0 writes the checkpoint metadata)."""

    def scatter_object(self, objs: list | None, src: int = 0) -> Any:
        """objs[r] from rank `src` on each rank r (the checkpoint writer hands out the files to write)."""

    def barrier(self) -> None:
        """Wait for every rank (no rank goes on before rank 0 has committed or moved a file)."""

    # ---- checkpoints and lifecycle -----------------------------------------------------------------------------
    def shard_spec(self, name: str) -> Any:
        """How parameter `name` is split over tensor parallelism (a ShardSpec), None when held whole: checkpoints
        store whole tensors, whatever the layout."""

    def describe_layout(self) -> dict:
        """world_size, tp, pp, dp, engine, zero_stage: printed, and recorded in checkpoints."""

    def close(self) -> None:
        """End of the job: tear the process groups down (the trainer calls it on a runtime it made itself)."""


class DataSource(Protocol):
    """The trainer's data: this rank's rows of each global batch, the validation batches, a resumable position."""

    @property
    def bytes_per_token(self) -> float | None:
        """Bytes of text per validation token (bits per byte come from it), None when unknown."""

    def prepare_ahead(self, prepare: Callable[[int, dict], None] | None) -> None:
        """Run prepare(step, batch) on each training batch in the prefetch thread (None: nothing)."""

    def read_first_batch(self) -> None:
        """Read the next training batch now, so that a data error surfaces before the run writes any file."""

    def train_batches(self) -> Iterator[dict]:
        """This rank's training batches ({"tokens", "sample_index"}) from the current position."""

    def val_batches(self) -> list[dict]:
        """The validation batches (the same at every call), empty without a validation split."""

    def epoch_of(self, batch: int) -> int:
        """The newest epoch among the samples of global batch `batch`, the same on every rank."""

    def stream_stats(self) -> dict:
        """Shard I/O so far: bytes_downloaded, hit_ratio (node cache), shards_skipped, ..."""

    def state_dict(self) -> dict:
        """The reading position, saved with a checkpoint."""

    def load_state_dict(self, state: dict) -> None:
        """Continue from a position state_dict returned (a resumed run)."""

    def seek(self, batch: int) -> None:
        """Make global batch `batch` the next one train_batches() yields (nothing to do when it is already)."""

    def close(self) -> None:
        """Stop the prefetch thread and release the files and groups the reader holds."""
