"""Counts the bytes autograd saves for backward while they are alive (CPU and GPU alike).

Inside `tracker.track()`, every tensor a forward saves for its backward is wrapped in a small holder; the holder
adds the tensor's bytes when it is made and subtracts them when autograd releases it (after the backward ran, or
when the graph is dropped). `live` and `peak` are those running totals. Views of one storage count once per save.
"""
from __future__ import annotations

import torch


class _Held:
    __slots__ = ("tensor", "nbytes", "tracker")

    def __init__(self, tensor: torch.Tensor, tracker: "SavedBytes"):
        self.tensor, self.nbytes, self.tracker = tensor, tensor.numel() * tensor.element_size(), tracker
        tracker.add(self.nbytes)

    def __del__(self):
        self.tracker.add(-self.nbytes)


class SavedBytes:
    """Live and peak bytes of the tensors autograd keeps for backward (see the module docstring)."""

    def __init__(self):
        self.live = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def track(self):
        """A context manager under which autograd's saved tensors are counted."""
        return torch.autograd.graph.saved_tensors_hooks(lambda t: _Held(t, self), lambda held: held.tensor)
