"""Run a tensor-parallel looped LM with a vocabulary-parallel head and loss.

The model stays megaloop's own nn.Module; pipeline only relies on this protocol (duck-typed, never imported):

    model(input_ids, labels=None, depth=..., backprop_depth=..., h0=..., noise_key=...) -> output with
        .loss, .logits (logits = the tied head applied to the final norm's output), .telemetry
    model.initial_state(e, noise_key) -> h_0 shaped like e   (drawn per global sample: layout-free), called by
        the model's forward when no h0 is given

After :func:`pipeline.tensor_parallel.apply_tensor_parallel` the model's own forward already runs the split layers
(the hooks communicate), the loop with per-sequence depths included; what changes is only (1) h_0, which must be
drawn for the whole sequence and cut to this rank's positions under sequence parallelism (the model's
initial_state is wrapped on the instance to do so, and a given h0 is cut the same way), and (2) the loss: the
logits are split along the vocabulary, so the model is called without labels and the loss is the
vocabulary-parallel cross-entropy. Telemetry is returned as the model computed it: under sequence parallelism the
state norms are means over this rank's positions (the trainer averages them over tp in its step's one reduction).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipeline.collectives import SEQ_DIM, chunk_along
from pipeline.tensor_parallel import TensorParallelInfo, apply_tensor_parallel
from pipeline.vocab_parallel import vocab_parallel_cross_entropy


class ParallelLM:
    """A tensor-parallel view of a looped LM: call it like the model (same arguments, same output type).

    Parameters, modes and state dicts are the model's own (`.model`); attribute look-ups fall through to it, so a
    trainer can use a ParallelLM wherever it used the model. The returned logits are this rank's vocabulary slice
    [B, S, V/tp] (full sequence); the loss is the full cross-entropy, equal on every tensor-parallel rank."""

    def __init__(self, model: nn.Module, layout, plan):
        self.model = model
        self.layout = layout
        self.tp_info: TensorParallelInfo = apply_tensor_parallel(model, plan, layout)
        self._group = layout.tp_group if layout.tp > 1 else None
        if self.tp_info.sequence_parallel and callable(getattr(model, "initial_state", None)):
            model.initial_state = _sequence_parallel_initial_state(model.initial_state, layout.tp, self._group)

    def __getattr__(self, name: str) -> Any:
        # only reached for names ParallelLM does not define
        return getattr(self.__dict__["model"], name)

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None, depth=None,
                backprop_depth=None, h0: torch.Tensor | None = None, noise_key=None):
        """The model's forward with the parallel h_0 and loss; see the module docstring."""
        if self._group is None:
            return self.model(input_ids, labels=labels, depth=depth, backprop_depth=backprop_depth, h0=h0,
                              noise_key=noise_key)
        if self.tp_info.sequence_parallel and h0 is not None:
            h0 = chunk_along(h0, SEQ_DIM, self._group)
        out = self.model(input_ids, labels=None, depth=depth, backprop_depth=backprop_depth, h0=h0,
                         noise_key=noise_key)
        if labels is not None:
            out.loss = vocab_parallel_cross_entropy(out.logits, labels, self.layout,
                                                    vocab_start=self.tp_info.vocab_range[0])
        return out


def _sequence_parallel_initial_state(draw, tp: int, group):
    """Wrap a model's initial_state(e, noise_key): draw h_0 for the whole sequence (tp x e's local positions)
    and keep this rank's positions, so every rank holds its slice of the single-process h_0."""

    def initial_state(e: torch.Tensor, noise_key=None) -> torch.Tensor:
        b, s_local, d = e.shape
        full = draw(e.new_empty((b, s_local * tp, d)), noise_key)
        return chunk_along(full, SEQ_DIM, group)

    return initial_state
