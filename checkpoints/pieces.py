"""What one rank contributes to a checkpoint, and how tensors map to stored bytes.

A checkpoint holds arrays of their GLOBAL shape (the shape the tensor has with no parallelism), named by
"/"-separated paths such as ``model/embed.weight``: the prefixes are zarr groups, the last component is a zarr
array (it may contain dots). Each rank declares the rectangular regions it holds as :class:`Piece` objects.

Stored bytes are the tensor's little-endian C-order bytes (zarr's plain ``bytes`` codec). zarr has no bfloat16,
so bf16 is stored as its uint16 view; every array records its torch dtype in the attribute ``torch_dtype``.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass

import numpy as np
import torch

# torch dtype name -> zarr data_type of the stored bytes
STORAGE_DTYPE = {
    "float64": "float64", "float32": "float32", "bfloat16": "uint16", "float16": "float16",
    "int64": "int64", "int32": "int32", "uint8": "uint8", "bool": "bool",
}
TORCH_DTYPES = {name: getattr(torch, name) for name in STORAGE_DTYPE}
ITEMSIZE = {name: torch.empty((), dtype=dt).element_size() for name, dt in TORCH_DTYPES.items()}

# Top-level names that hold the checkpoint's own files; an array may not take them.
RESERVED_TOP = {"metadata.json", "manifest.json", "COMMIT", "ABORTED", "zarr.json"}
_COMPONENT = re.compile(r"^[A-Za-z0-9_.+\-]+$")


@dataclass
class Piece:
    """One rank's rectangular region of a global array."""

    name: str                    # array path inside the checkpoint, e.g. "model/embed.weight"
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]     # where tensor starts inside the global array
    tensor: torch.Tensor         # the local data (any device, any dtype of STORAGE_DTYPE)


def dtype_name(dtype: torch.dtype) -> str:
    """The name recorded for a torch dtype ("bfloat16", ...); ValueError for a dtype we do not store."""
    name = str(dtype).removeprefix("torch.")
    if name not in STORAGE_DTYPE:
        raise ValueError(f"dtype {dtype} cannot be checkpointed; use one of {sorted(STORAGE_DTYPE)}")
    return name


def validate_name(name: str) -> None:
    """Refuse array names that would escape the directory or clash with the checkpoint's own files."""
    parts = name.split("/") if isinstance(name, str) else [""]
    bad = (not name or any(p in ("", ".", "..") or p.startswith("__") or not _COMPONENT.match(p) for p in parts)
           or parts[0] in RESERVED_TOP or parts[0].startswith(("manifest.", "failed.")) or "zarr.json" in parts)
    if bad:
        raise ValueError(f"invalid checkpoint array name {name!r}; use '/'-separated components of letters, digits "
                         f"and _.+- (no empty, '.', '..' or '__'-prefixed parts, not {sorted(RESERVED_TOP)})")


def validate_piece(piece: Piece) -> None:
    """ValueError when a piece's name, shapes or dtype cannot be stored."""
    validate_name(piece.name)
    dtype_name(piece.tensor.dtype)
    g, o, s = tuple(piece.global_shape), tuple(piece.offsets), tuple(piece.tensor.shape)
    if not (len(g) == len(o) == len(s)) or any(x < 0 for x in g + o) or any(
            oo + ss > gg for oo, ss, gg in zip(o, s, g)):
        raise ValueError(f"piece {piece.name!r}: region offsets {o} shape {s} does not fit global shape {g}; "
                         "give offsets and a tensor inside the global array, one entry per dimension")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The stored bytes of a contiguous CPU tensor (little-endian, C order), without copying on little-endian hosts."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    arr = t.numpy()
    if t.dtype == torch.int16:
        arr = arr.view(np.uint16)
    if sys.byteorder != "little" and arr.dtype.itemsize > 1:
        arr = arr.byteswap()
    return memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))


def numpy_to_tensor(arr: np.ndarray, torch_dtype: str) -> torch.Tensor:
    """A torch tensor of the recorded dtype from what zarr returned (bf16 comes back as its uint16 view)."""
    arr = np.asarray(arr)
    if not arr.flags.c_contiguous or not arr.flags.writeable:
        arr = arr.copy()  # keeps 0-d arrays 0-d (np.ascontiguousarray would make them 1-d)
    if torch_dtype == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def chunk_key(index: tuple[int, ...]) -> str:
    """zarr v3's default chunk key (separator "/"): ``c/i/j`` for chunk (i, j), ``c`` for a 0-d array."""
    return "/".join(["c", *map(str, index)])
