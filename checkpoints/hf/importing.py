"""Read a Hugging Face folder written by ``export-hf`` back into a megaloop checkpoint.

The megaloop config is derived from config.json alone (MegaloopConfig's fields mapped back, plus the training-only
fields export-hf keeps under ``megaloop``), and the weights are checked strictly against the model that config
builds: a missing, unexpected or mis-shaped tensor is an error naming it. The checkpoint holds model/* arrays only,
bit for bit the folder's tensors, and can be trained from with ``checkpoint.resume=OUT
checkpoint.load_optimizer=false`` or evaluated like any other.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..official import write_model_checkpoint
from .export import FIELDS, TRAINING_FIELDS, WEIGHT_PREFIX


def read_hf_config(folder: Path) -> dict:
    """config.json of an export-hf folder; CheckpointError when it is missing or not a megaloop model."""
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder}: no config.json; give a folder written by `python -m checkpoints "
                              "export-hf`")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise CheckpointError(f"{path}: not JSON ({exc}); give the folder's config.json unchanged") from None
    if not isinstance(config, dict) or config.get("model_type") != "megaloop":
        kind = config.get("model_type") if isinstance(config, dict) else None
        raise CheckpointError(f"{path}: model_type {kind!r}, not 'megaloop'; import-hf reads folders written by "
                              "`python -m checkpoints export-hf` (official Parcae releases: `convert "
                              "--from-official`)")
    return config


def megaloop_model_section(hf: dict) -> dict:
    """megaloop's model section (ModelConfig fields) for an export-hf config.json."""
    model = {ours: hf[theirs] for ours, theirs in FIELDS.items() if theirs in hf}
    kept = (hf.get("megaloop") or {}).get("model") or {}
    model.update({k: kept[k] for k in TRAINING_FIELDS if k in kept})
    return model


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of model.safetensors, or of the shards model.safetensors.index.json lists."""
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(f"{folder}: no model.safetensors (nor model.safetensors.index.json); give a folder "
                              "written by `python -m checkpoints export-hf`")
    out: dict[str, torch.Tensor] = {}
    for name in files:
        if not (folder / name).is_file():
            raise CheckpointError(f"{folder}: the index names {name}, which is missing; copy the whole folder")
        out.update(load_file(str(folder / name), device="cpu"))
    return out


def expected_shapes(hf_config: dict) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the model hf_config builds (built on the meta device from this package's
    modeling file, so nothing of the folder's own code runs)."""
    from .configuration_megaloop import MegaloopConfig
    from .modeling_megaloop import MegaloopForCausalLM

    fields = {k: v for k, v in hf_config.items() if k not in ("auto_map", "architectures", "megaloop")}
    try:
        config = MegaloopConfig(**fields)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"config.json does not describe a megaloop model ({exc}); give the folder's "
                              "config.json unchanged") from None
    with torch.device("meta"):
        model = MegaloopForCausalLM(config)
    return {n: tuple(p.shape) for n, p in model.state_dict().items()}


def checked_weights(weights: dict[str, torch.Tensor], shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """megaloop name -> tensor; CheckpointError naming every missing, unexpected or mis-shaped tensor."""
    missing = sorted(set(shapes) - set(weights))
    extra = sorted(set(weights) - set(shapes))
    wrong = sorted(f"{n} {tuple(weights[n].shape)} (expected {shapes[n]})" for n in set(shapes) & set(weights)
                   if tuple(weights[n].shape) != shapes[n])
    problems = [f"{what}: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}"
                for what, names in (("missing tensors", missing), ("unexpected tensors", extra),
                                    ("tensors of another shape", wrong)) if names]
    if problems:
        raise CheckpointError(f"the weights do not fit config.json ({'; '.join(problems)}); give the folder "
                              "export-hf wrote, unchanged")
    return {n[len(WEIGHT_PREFIX):]: t for n, t in weights.items()}


def import_hf(folder, out_root, step: int | None = None) -> Path:
    """Write the export-hf folder `folder` as a megaloop checkpoint under `out_root` (a new or empty directory);
    returns the committed step directory. `step` defaults to the step export-hf recorded (else 0)."""
    folder, out_root = Path(folder), Path(out_root)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such directory; give a folder written by `python -m checkpoints "
                              "export-hf`")
    if out_root.exists() and (not out_root.is_dir() or any(out_root.iterdir())):
        raise CheckpointError(f"{out_root}: exists and is not an empty directory; give a new directory for the "
                              "imported checkpoint")
    hf = read_hf_config(folder)
    weights = checked_weights(read_weights(folder), expected_shapes(hf))
    if step is None:
        step = int((hf.get("megaloop") or {}).get("step") or 0)
    metadata = {"config": {"model": megaloop_model_section(hf)}, "source": "hugging-face", "tokens": 0}
    return write_model_checkpoint(out_root, weights, metadata, step, "import")
