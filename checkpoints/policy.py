"""What the reader accepts in a zarr.json: exactly what our writer produces, checked with ``json`` before zarr
ever opens the array. Anything else (other codecs such as pickle/object codecs, other data types, storage
transformers, unknown keys) is refused, so a planted file can never make zarr or numcodecs execute code.
"""
from __future__ import annotations

import json
from pathlib import Path

from .errors import CheckpointError, CorruptCheckpointError
from .pieces import STORAGE_DTYPE

ARRAY_KEYS = {"shape", "data_type", "chunk_grid", "chunk_key_encoding", "fill_value", "codecs", "attributes",
              "zarr_format", "node_type", "storage_transformers", "dimension_names"}
BYTES_CODECS = ([{"name": "bytes"}], [{"name": "bytes", "configuration": {"endian": "little"}}])
CHUNK_KEYS = {"name": "default", "configuration": {"separator": "/"}}
PICKLE_MAGIC = b"\x80"


def load_json(path: Path, what: str, corrupt=CorruptCheckpointError):
    """Parse a JSON file with ``json`` only; a binary (e.g. pickled) payload is refused, never unpickled."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise corrupt(f"{path}: {what} is missing; the checkpoint is incomplete: load an older one") from None
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        hint = " (it looks like a pickle; it was not unpickled)" if raw[:1] == PICKLE_MAGIC else ""
        raise corrupt(f"{path}: {what} is not JSON{hint}; refusing to load it: use a checkpoint written by "
                      "checkpoints.save") from None


def check_array_json(path: Path, name: str, shape: tuple, dtype: str, chunks: tuple) -> dict:
    """Refuse (CheckpointError naming the file) any zarr.json but a plain array of the recorded shape/dtype/chunks."""
    meta = load_json(path, f"zarr.json of array {name!r}")
    problem = _array_json_problem(meta, shape, dtype, chunks)
    if problem:
        raise CheckpointError(f"{path}: array {name!r} refused: {problem}; only arrays written by "
                              "checkpoints.save (bytes codec, no compression or object codecs) are loaded")
    return meta


def _array_json_problem(meta, shape, dtype, chunks) -> str | None:
    if not isinstance(meta, dict):
        return "zarr.json is not an object"
    if meta.get("zarr_format") != 3 or meta.get("node_type") != "array":
        return "not a zarr v3 array"
    if set(meta) - ARRAY_KEYS:
        return f"unexpected keys {sorted(set(meta) - ARRAY_KEYS)}"
    if meta.get("codecs") not in BYTES_CODECS:
        return f"codecs {json.dumps(meta.get('codecs'))[:200]} (only the plain little-endian bytes codec)"
    if meta.get("storage_transformers", []) != []:
        return "storage transformers are not allowed"
    attrs = meta.get("attributes")
    torch_dtype = attrs.get("torch_dtype") if isinstance(attrs, dict) else None
    if torch_dtype not in STORAGE_DTYPE:
        return f"torch_dtype attribute {torch_dtype!r} is not one of {sorted(STORAGE_DTYPE)}"
    if meta.get("data_type") != STORAGE_DTYPE[torch_dtype]:
        return f"data_type {meta.get('data_type')!r} does not store torch dtype {torch_dtype}"
    if torch_dtype != dtype or meta.get("shape") != list(shape):
        return f"shape/dtype {meta.get('shape')} {torch_dtype} differ from metadata.json ({list(shape)} {dtype})"
    grid = meta.get("chunk_grid")
    if grid != {"name": "regular", "configuration": {"chunk_shape": list(chunks)}}:
        return f"chunk grid {json.dumps(grid)[:200]} differs from metadata.json's chunks {list(chunks)}"
    if meta.get("chunk_key_encoding") != CHUNK_KEYS:
        return "chunk key encoding is not zarr's default with '/'"
    if meta.get("fill_value") not in (0, False):
        return f"fill_value {meta.get('fill_value')!r} (expected 0)"
    return None


def check_group_json(path: Path) -> None:
    meta = load_json(path, "group zarr.json")
    if not (isinstance(meta, dict) and meta.get("node_type") == "group" and meta.get("zarr_format") == 3):
        raise CheckpointError(f"{path}: not a zarr v3 group; only checkpoints written by checkpoints.save load")
