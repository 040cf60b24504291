"""The looped LM (Parcae, additive, RDM) and the GPT baseline; architecture only."""
from __future__ import annotations

import torch

from megaloop.config.model import ModelConfig
from megaloop.model.init import init_parameter, materialize
from megaloop.model.looped import LoopContext, LoopedLM, ModelOutput


def build_model(model_config: ModelConfig, device: str | torch.device | None = None, seed: int = 0) -> LoopedLM:
    """Validate the config and build the model. device "meta" allocates nothing (for counting, or for a caller that
    materialises only the parameters it holds: megaloop.model.init.materialize); otherwise the parameters get the
    reference initialisation from `seed` (fp32, on `device`): the same bits as materialize on a meta build. Without
    `device`, the ambient default device decides, as for any torch module: the CPU, or what an enclosing
    `with torch.device(...)` names (so `with torch.device("meta"): build_model(cfg)` counts without allocating)."""
    model_config.validate()
    device = torch.device(device) if device is not None else torch.get_default_device()
    with torch.device("meta"):
        model = LoopedLM(model_config)
    if device.type == "meta":
        return model
    with torch.device("cpu"):  # the reference values are computed on the CPU whatever the ambient device
        return materialize(model, seed=seed, device=device)


def count_parameters(model: torch.nn.Module) -> int:
    """Unique parameters (the tied head counts once)."""
    return sum(p.numel() for p in model.parameters())


__all__ = ["build_model", "count_parameters", "init_parameter", "materialize", "LoopedLM", "LoopContext",
           "ModelOutput"]
