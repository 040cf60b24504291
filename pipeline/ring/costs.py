"""Per-action costs of a ring-pipeline schedule (arbitrary time units; one forward lap segment = 1 by default)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from pipeline.ring.actions import (
    Backward,
    Compute,
    Embed,
    EmbedBackward,
    Forward,
    Loss,
    LossBackward,
    MicroBatch,
)


@dataclass(frozen=True)
class CostModel:
    """Durations of the compute actions and the point-to-point latency.

    forward / backward / nograd_forward are one lap segment's costs with every row active; a lap of a ragged
    micro-batch costs that times its active fraction. embed and loss (and their backwards) are the extra work of
    rank 0 (embedding, prelude) and rank p-1 (C, coda, head, loss). A message arrives `latency` after its send.
    """

    forward: float = 1.0
    backward: float = 2.0
    nograd_forward: float = 1.0
    embed: float = 0.0
    embed_backward: float = 0.0
    loss: float = 0.0
    loss_backward: float = 0.0
    latency: float = 0.0

    def __post_init__(self):
        negative = [name for name, value in vars(self).items() if value < 0]
        if negative:
            raise ValueError(f"costs must be >= 0; negative: {', '.join(negative)}")

    def of(self, action: Compute, specs: Sequence[MicroBatch]) -> float:
        """The duration of one compute action of the micro-batches `specs`."""
        if isinstance(action, Forward):
            unit = self.forward if action.grad else self.nograd_forward
            return unit * specs[action.mb].active_fraction(action.lap)
        if isinstance(action, Backward):
            return self.backward * specs[action.mb].active_fraction(action.lap)
        return {Embed: self.embed, EmbedBackward: self.embed_backward, Loss: self.loss,
                LossBackward: self.loss_backward}[type(action)]
