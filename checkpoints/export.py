"""Export a checkpoint's weights for use outside megaloop: one safetensors file plus a JSON file beside it.

``export_safetensors(ckpt, "out/model.safetensors")`` writes

* ``out/model.safetensors``: every model parameter under its megaloop name (``embed.weight``,
  ``core.0.attn.q.weight``, ...), no optimizer state; the tied output head is ``embed.weight`` itself;
* ``out/model.json``: ``{"format", "step", "tokens", "dtype", "config"}``, where config is megaloop's resolved
  config tree of the run (its ``model`` section builds the model).

A downstream user needs only ``safetensors.torch.load_file`` and ``json``; with megaloop::

    model = build_model(ModelConfig(**json.load(open("out/model.json"))["config"]["model"]))
    model.load_state_dict(safetensors.torch.load_file("out/model.safetensors"), strict=True)

Each file is written under a temporary name and renamed into place, so no half-written file is ever visible.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .errors import CheckpointError
from .load import CheckpointReader
from .official import MODEL_PREFIX, model_array_names

FORMAT = "megaloop-safetensors"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def export_safetensors(checkpoint_dir, out_path, dtype: str | None = None) -> Path:
    """Write the model parameters of a committed checkpoint to `out_path` (a ``.safetensors`` file) and its config
    and step to the ``.json`` of the same stem beside it; returns `out_path`. `dtype` "bf16" or "fp32" casts the
    floating-point parameters (None keeps the stored dtypes). The files are verified against the manifest first."""
    from safetensors.torch import save_file

    out_path = Path(out_path)
    if out_path.suffix != ".safetensors":
        raise CheckpointError(f"{out_path}: the export is a .safetensors file; give an --out path ending in "
                              ".safetensors (its config goes to the .json beside it)")
    if out_path.is_dir():
        raise CheckpointError(f"{out_path}: is a directory; give a file path such as {out_path / 'model.safetensors'}")
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)} (or none to keep "
                              "the stored dtypes)")
    reader = CheckpointReader(checkpoint_dir)
    config = reader.metadata.get("config")
    if not isinstance(config, dict):
        raise CheckpointError(f"{reader.path}: metadata.json holds no config; export checkpoints written by "
                              "megaloop training or by `python -m checkpoints convert`")
    names = model_array_names(reader)
    reader.verify(names)
    tensors = {}
    for array in names:
        t = reader.read(array)
        if dtype is not None and t.is_floating_point():
            t = t.to(DTYPES[dtype])
        tensors[array[len(MODEL_PREFIX):]] = t.contiguous()
    sidecar = {"format": FORMAT, "step": reader.step, "tokens": reader.metadata.get("tokens"),
               "dtype": dtype or "as stored", "config": config}
    header = {"format": "pt", "megaloop_step": str(reader.step)}
    json_path = out_path.with_suffix(".json")
    replace_atomically(json_path, lambda tmp: tmp.write_text(json.dumps(sidecar, indent=1) + "\n"))
    replace_atomically(out_path, lambda tmp: save_file(tensors, str(tmp), metadata=header))
    return out_path


def replace_atomically(out_path: Path, write) -> None:
    """Call write(tmp) for a temporary file beside `out_path`, flush it to disk, then rename it over `out_path`:
    a reader sees the old file or the whole new one, and a failed write leaves nothing behind."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        with open(tmp, "xb"):
            mode = os.stat(tmp).st_mode & 0o777  # what the umask gives a new file
        write(tmp)
        os.chmod(tmp, mode)  # safetensors writes its files private (0600); keep them like any other output
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
