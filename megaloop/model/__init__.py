"""The looped LM (Parcae, additive, RDM) and the GPT baseline; architecture only."""
from __future__ import annotations

import torch

from megaloop.config.model import ModelConfig
from megaloop.model.looped import LoopContext, LoopedLM, ModelOutput


def build_model(model_config: ModelConfig, device: str | torch.device | None = None, seed: int = 0) -> LoopedLM:
    """Validate the config and build the model. device "meta" allocates nothing (for counting); otherwise the
    parameters get the reference initialisation from `seed`."""
    model_config.validate()
    if device is not None and torch.device(device).type == "meta":
        with torch.device("meta"):
            return LoopedLM(model_config)
    model = LoopedLM(model_config)
    if device is not None:
        model = model.to(device)
    model.reset_parameters(seed)
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Unique parameters (the tied head counts once)."""
    return sum(p.numel() for p in model.parameters())


__all__ = ["build_model", "count_parameters", "LoopedLM", "LoopContext", "ModelOutput"]
