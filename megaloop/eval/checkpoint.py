"""A committed checkpoint as one process's whole model, whatever layout saved it.

`load_model(path)` accepts a run directory (its `checkpoints/` root), a checkpoint root or one `step_XXXXXXXX`
directory, verifies the model arrays against the manifest and reads each whole (checkpoints are layout-free global
arrays: a tp2 x dp2 save reads back as the single-process tensors). The model is built from the checkpoint's own
config, or from `model_config` when given, in which case every array must fit it exactly (a checkpoint of another
architecture is an error, not a partial load).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megaloop.config import ConfigError
from megaloop.config.model import ModelConfig
from megaloop.eval.errors import EvalInputError

__all__ = ["EvalInputError", "LoadedModel", "checkpoint_dir", "load_model"]


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: dict  # the checkpoint's resolved config tree
    path: Path  # the step directory read
    step: int

    @property
    def model_config(self) -> ModelConfig:
        return self.model.cfg


def checkpoint_dir(path) -> Path:
    """The committed step directory that `path` names: itself, or the newest committed one under a checkpoint root
    or a run directory's `checkpoints/`."""
    from checkpoints import find_checkpoints

    path = Path(path)
    if not path.exists():
        raise EvalInputError(f"{path}: no such file or directory; give a run directory, a checkpoint root or a "
                             "step_XXXXXXXX checkpoint directory")
    if path.is_dir() and (path / "COMMIT").is_file():
        return path
    roots = [path / "checkpoints", path] if path.is_dir() else []
    for root in roots:
        found = find_checkpoints(root) if root.is_dir() else []
        if found:
            return found[0]
    raise EvalInputError(f"{path}: holds no committed checkpoint (no step_XXXXXXXX directory with a COMMIT marker); "
                         "give a run directory or checkpoint written by `megaloop train`")


def run_precision(path) -> str:
    """The train.precision the checkpoint's run computed in (fp32 where it is not recorded or was left "auto")."""
    from checkpoints import CheckpointError, CheckpointReader

    try:
        config = CheckpointReader(checkpoint_dir(path)).metadata.get("config") or {}
    except CheckpointError as err:
        raise EvalInputError(str(err)) from None
    precision = config.get("train", {}).get("precision")
    return precision if precision in ("fp32", "bf16", "fp64") else "fp32"


def load_model(path, model_config: ModelConfig | None = None, device="cpu",
               dtype: torch.dtype = torch.float32) -> LoadedModel:
    """The model of the newest committed checkpoint at `path` (see the module docstring), in eval mode."""
    from checkpoints import CheckpointError, CheckpointReader

    from megaloop.config.load import from_dict
    from megaloop.model import build_model

    step_dir = checkpoint_dir(path)
    try:
        reader = CheckpointReader(step_dir)
        config = reader.metadata.get("config")
        if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
            raise EvalInputError(f"{step_dir}: metadata.json holds no model config; give a checkpoint written by "
                                 "`megaloop train` or `python -m checkpoints convert`")
        saved = from_dict(ModelConfig, config["model"], "model.")
        cfg = model_config or saved
        cfg.validate()
        model = build_model(cfg, device="meta")
        names = {f"model/{n}": p for n, p in model.named_parameters()}
        _check_architecture(step_dir, reader.arrays, names, cfg is not saved)
        reader.verify(sorted(names))
        state = {n[len("model/"):]: reader.read(n) for n in names}
    except CheckpointError as err:
        raise EvalInputError(str(err)) from None
    except ConfigError as err:
        raise EvalInputError(f"{step_dir}: {err}") from None
    model = build_model(cfg, device="meta").to_empty(device=device)  # RoPE tables recomputed (LoopedLM._apply)
    model.load_state_dict(state, strict=True)
    model = model.to(dtype=dtype)
    model.eval()
    return LoadedModel(model, config, step_dir, reader.step)


def _check_architecture(step_dir: Path, arrays: dict, expected: dict, given_config: bool) -> None:
    held = {n: a for n, a in arrays.items() if n.startswith("model/")}
    if not held:
        raise EvalInputError(f"{step_dir}: holds no model/* arrays; give a checkpoint written by megaloop training")
    missing = sorted(set(expected) - set(held))
    extra = sorted(set(held) - set(expected))
    wrong = sorted(n for n in set(expected) & set(held) if tuple(held[n].shape) != tuple(expected[n].shape))
    if not (missing or extra or wrong):
        return
    what = (f"array {wrong[0]} has shape {tuple(held[wrong[0]].shape)}, the model's is "
            f"{tuple(expected[wrong[0]].shape)}" if wrong else
            f"the model needs {missing[0]}, which it lacks" if missing else f"it holds {extra[0]}, which the model lacks")
    fix = ("drop --config to use the checkpoint's own model config" if given_config else
           "the checkpoint's arrays do not fit its own config: it is damaged or was written by another version")
    raise EvalInputError(f"{step_dir}: a checkpoint of another architecture ({what}; {len(missing)} missing, "
                         f"{len(extra)} extra, {len(wrong)} of another shape); {fix}")
