"""What a ring-pipeline rank computes: the stage program a model adapter implements for the executor.

The executor (`pipeline.ring.execute`) owns the communication and the autograd bookkeeping; a stage program only
computes. Ring rank 0 calls `embed`, every rank calls `lap_segment` for its own core segment, the last rank calls
`loss`; every rank calls `message_shape` to size its receives. A program is free of torch.distributed.
"""
from __future__ import annotations

from typing import Optional, Protocol

import torch


class StageProgram(Protocol):
    """One ring rank's share of a looped model (see the module docstring).

    Weights a stage reuses in every lap accumulate their gradients across laps through autograd; the program does
    nothing for it.
    """

    def embed(self, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank 0: micro-batch `mb`'s embedding e (embedding, prelude, norm; kept for every lap) and the state h_0
        entering lap 0. Runs with autograd enabled; the executor back-propagates e's accumulated gradient through
        it at EmbedBackward."""

    def lap_segment(self, mb: int, lap: int, h: torch.Tensor, e: Optional[torch.Tensor]) -> torch.Tensor:
        """This rank's core segment in lap `lap` of micro-batch `mb`: h is the state from the previous ring rank
        (rank 0: the previous lap's output, or h_0); e is given on rank 0 only (None elsewhere), where the segment
        applies the injection first. Returns the state sent to the next ring rank, of shape
        `message_shape(mb, lap)`."""

    def loss(self, mb: int, h: torch.Tensor) -> torch.Tensor:
        """The last rank: micro-batch `mb`'s scalar loss from the state leaving its last lap, already scaled as the
        optimizer step wants it (e.g. divided by the number of micro-batches)."""

    def message_shape(self, mb: int, lap: int) -> tuple[int, ...]:
        """The shape of the state leaving lap `lap` of micro-batch `mb` on every stage (rows still active x
        sequence x width under the ragged loop); its gradient has the same shape."""
