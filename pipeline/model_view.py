"""What a runtime's wrapper of the model exposes to the trainer besides its call: the wrapped model's parameters
(those the wrapper `holds`) and its train/eval mode. ParallelLM (all parameters, split in place) and PipelineStage
(this stage's parameters) are such views; neither is an nn.Module itself."""
from __future__ import annotations


class ModelView:
    """A view of `self.model` (an nn.Module): named_parameters / parameters filtered by `holds`, and its modes."""

    model = None

    def holds(self, name: str) -> bool:
        """Whether the parameter `name` is this view's (every one by default)."""
        return True

    def named_parameters(self, *args, **kwargs):
        return [(n, p) for n, p in self.model.named_parameters(*args, **kwargs) if self.holds(n)]

    def parameters(self, *args, **kwargs):
        return [p for _, p in self.named_parameters(*args, **kwargs)]

    @property
    def training(self) -> bool:
        return self.model.training

    def train(self, mode: bool = True):
        self.model.train(mode)
        return self

    def eval(self):
        return self.train(False)
