"""The actions of a ring-pipeline schedule, and the chain of actions one micro-batch goes through.

A micro-batch's work is one linear chain (each action consumes what the previous one produced):

    Embed                       rank 0: embedding, prelude, norm -> e (kept for every lap) and h_0
    Forward(lap 0, stage 0..p-1) ... Forward(lap L-1, stage 0..p-1)
                                stage s runs on rank s; lap l < L - k without autograd (grad=False, nothing
                                stored), the last k laps with autograd; stage 0 applies the injection A h + B e
    Loss                        rank p-1: C, coda, norm, head and the loss (kept for its backward)
    LossBackward                rank p-1
    Backward(lap L-1, stage p-1..0) ... Backward(lap L-k, stage p-1..0)
                                reverse ring order; stage 0 accumulates e's gradient locally; the gradient of
                                the state entering lap L-k is dropped (truncated backprop)
    EmbedBackward               rank 0: the prelude's and embedding's backward with e's accumulated gradient

Embedding and loss are actions of their own (not folded into the first and last lap) so that their costs and
their stored activations show separately. Where two consecutive actions of a chain run on different ranks, the
producer's rank has a Send and the consumer's rank a Recv of the same :class:`Message`. Every schedule, whatever
made it, is a list of these actions per rank, executed in order.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Union


class ScheduleError(ValueError):
    """A schedule or its inputs that cannot be run; the message says what is wrong."""


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch's loop: `laps` laps around the ring (its deepest sequence's depth), the last `grad_laps` of
    them with autograd; `active[l]` is the fraction of its rows still looping in lap l (ragged loop; all 1.0 when
    empty), which scales that lap's costs."""

    laps: int
    grad_laps: int
    active: tuple[float, ...] = ()

    def __post_init__(self):
        laps, grad = operator.index(self.laps), operator.index(self.grad_laps)
        if laps < 1 or not 1 <= grad <= laps:
            raise ScheduleError(f"a micro-batch needs laps >= 1 and 1 <= grad_laps <= laps, got laps={laps}, "
                                f"grad_laps={grad}")
        if self.active and (len(self.active) != laps or not all(0.0 < a <= 1.0 for a in self.active)):
            raise ScheduleError(f"active must hold one fraction in (0, 1] per lap ({laps}), got {self.active}")

    @property
    def first_grad_lap(self) -> int:
        return self.laps - self.grad_laps

    def active_fraction(self, lap: int) -> float:
        return self.active[lap] if self.active else 1.0


@dataclass(frozen=True)
class Embed:
    mb: int


@dataclass(frozen=True)
class Forward:
    mb: int
    lap: int
    stage: int
    grad: bool


@dataclass(frozen=True)
class Loss:
    mb: int


@dataclass(frozen=True)
class LossBackward:
    mb: int


@dataclass(frozen=True)
class Backward:
    mb: int
    lap: int
    stage: int


@dataclass(frozen=True)
class EmbedBackward:
    mb: int


Compute = Union[Embed, Forward, Loss, LossBackward, Backward, EmbedBackward]


@dataclass(frozen=True)
class Message:
    """What travels between neighbours: the output of `producer` (an activation after a forward, the input
    gradient after a backward)."""

    producer: Compute

    @property
    def kind(self) -> str:
        return "gradient" if isinstance(self.producer, Backward) else "activation"


@dataclass(frozen=True)
class Send:
    dst: int
    message: Message


@dataclass(frozen=True)
class Recv:
    src: int
    message: Message


Action = Union[Compute, Send, Recv]
COMPUTE_TYPES = (Embed, Forward, Loss, LossBackward, Backward, EmbedBackward)


def rank_of(action: Compute, pp: int) -> int:
    """The ring rank that runs a compute action."""
    if isinstance(action, (Embed, EmbedBackward)):
        return 0
    if isinstance(action, (Loss, LossBackward)):
        return pp - 1
    return action.stage


def chain(mb: int, spec: MicroBatch, pp: int) -> list[Compute]:
    """The compute actions of micro-batch `mb`, in data-dependency order (see the module docstring)."""
    actions: list[Compute] = [Embed(mb)]
    for lap in range(spec.laps):
        grad = lap >= spec.first_grad_lap
        actions += [Forward(mb, lap, stage, grad) for stage in range(pp)]
    actions += [Loss(mb), LossBackward(mb)]
    for lap in reversed(range(spec.first_grad_lap, spec.laps)):
        actions += [Backward(mb, lap, stage) for stage in reversed(range(pp))]
    actions.append(EmbedBackward(mb))
    return actions


def is_compute(action: Action) -> bool:
    return isinstance(action, COMPUTE_TYPES)


def label(action: Action) -> str:
    """A short human-readable name, e.g. 'F3.2s1' (micro-batch 3, lap 2, stage 1), 'f' when without autograd."""
    if isinstance(action, Forward):
        return f"{'F' if action.grad else 'f'}{action.mb}.{action.lap}s{action.stage}"
    if isinstance(action, Backward):
        return f"B{action.mb}.{action.lap}s{action.stage}"
    if isinstance(action, (Send, Recv)):
        peer = action.dst if isinstance(action, Send) else action.src
        return f"{type(action).__name__}({label(action.message.producer)}, {peer})"
    return f"{type(action).__name__}{action.mb}"
