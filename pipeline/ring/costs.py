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
    Message,
    MicroBatch,
)


@dataclass(frozen=True)
class CostModel:
    """Durations of the compute actions and the point-to-point latency.

    forward / backward / nograd_forward are one lap segment's costs with every row active; a lap of a ragged
    micro-batch costs that times its active fraction. embed and loss (and their backwards) are the extra work of
    rank 0 (embedding, prelude) and rank p-1 (C, coda, head, loss). A message takes `delay` to arrive: `latency`
    plus `latency_per_byte` times its bytes (`message_bytes` with every row active, times the active fraction of
    the lap whose state or gradient it carries). It arrives that long after its Send, or, with `rendezvous`, after
    the later of its Send and its Recv's posting (gloo's point-to-point moves the payload only once the receiver
    has posted its buffer; the executor posts a run of Sends and Recvs together, at the end of the compute action
    before it). The generator plans with `latency` alone; the other three (by default zero and off) refine the
    simulation.
    """

    forward: float = 1.0
    backward: float = 2.0
    nograd_forward: float = 1.0
    embed: float = 0.0
    embed_backward: float = 0.0
    loss: float = 0.0
    loss_backward: float = 0.0
    latency: float = 0.0
    latency_per_byte: float = 0.0
    message_bytes: float = 0.0
    rendezvous: bool = False

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

    def delay(self, message: Message, specs: Sequence[MicroBatch]) -> float:
        """How long `message` takes from its Send (with `rendezvous`: from the later of Send and Recv posting) to
        its arrival."""
        if not self.latency_per_byte:
            return self.latency
        producer = message.producer
        lap = producer.lap - 1 if isinstance(producer, Backward) and producer.stage == 0 else producer.lap
        return self.latency + self.latency_per_byte * self.message_bytes * specs[producer.mb].active_fraction(lap)
