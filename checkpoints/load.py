"""Reading checkpoints: find the committed ones, check them, read any region of any array.

Nothing here unpickles: metadata.json, manifest.json and every zarr.json are parsed with ``json``, and an array is
opened with zarr only after its zarr.json passed :mod:`checkpoints.policy` (plain bytes codec, allowed dtypes).
Reads go through zarr slicing, so only the chunks a region touches are read; a region can be any rectangle, which
is what lets a job resume with a different tensor/pipeline/data-parallel layout.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import zarr

from . import files
from .errors import CheckpointError, CorruptCheckpointError
from .pieces import ITEMSIZE, STORAGE_DTYPE, TORCH_DTYPES, chunk_key, numpy_to_tensor, validate_name
from .policy import check_array_json, load_json
from .verify import chunk_files, find_problems

CORRUPT_ADVICE = ("this checkpoint is corrupt: give an older step_XXXXXXXX directory beside it instead (`python -m "
                  "checkpoints verify ROOT --all` shows which verify; a training run falls back to one by itself)")


@dataclass(frozen=True)
class ArrayInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[int, ...]

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype_name]


def find_checkpoints(root) -> list[Path]:
    """Committed checkpoint directories under `root`: the one ``latest`` names first, then newest step first."""
    root = Path(root)
    found = files.committed_dirs(root)
    latest = files.read_latest(root)
    return sorted(found, key=lambda p: p.name != latest)  # stable: keeps newest-first after the latest one


class CheckpointReader:
    """One committed checkpoint directory. Construction reads metadata.json and manifest.json only.

    It counts what it reads, so that a resume can say what it cost: `bytes_read` is the bytes of the chunk files
    that read() fetched (zarr reads a chunk whole, so a region that cuts a chunk counts the whole chunk), by array in
    `bytes_by_array`; `bytes_verified` the bytes of the files verify() checksummed (their sizes in the manifest,
    metadata.json and the arrays' zarr.json included). The JSON files read to open the checkpoint and its arrays
    are not counted."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: no such directory; give a checkpoint directory (step_XXXXXXXX)")
        if not (self.path / "COMMIT").is_file():
            raise CheckpointError(f"{self.path}: no COMMIT marker (the save did not finish); use a committed "
                                  "checkpoint, e.g. from find_checkpoints(root)")
        self.metadata = _checked_metadata(self.path)
        self.step: int = self.metadata["step"]
        self.manifest = _checked_manifest(self.path)
        self._arrays = {name: ArrayInfo(tuple(a["shape"]), TORCH_DTYPES[a["dtype"]], tuple(a["chunks"]))
                        for name, a in self.metadata["arrays"].items()}
        self._opened: dict[str, zarr.Array] = {}
        self.bytes_by_array: dict[str, int] = {}
        self.bytes_verified = 0

    @property
    def bytes_read(self) -> int:
        """Chunk-file bytes fetched by read() so far (see the class docstring)."""
        return sum(self.bytes_by_array.values())

    @property
    def arrays(self) -> dict[str, ArrayInfo]:
        return dict(self._arrays)

    def problems(self, names=None, limit: int | None = None) -> list[str]:
        """Every integrity problem of these arrays' files (None: of every file), as one-line strings."""
        recorded = {n: (a.shape, a.dtype_name, a.chunks) for n, a in self._arrays.items()}
        return find_problems(self.path, recorded, self.manifest, self._known(names), limit)

    def verify(self, names=None) -> None:
        """Check size and checksum of every file of these arrays (None: all files); CorruptCheckpointError naming
        the array, the file and what is wrong."""
        found = self.problems(names)
        self.bytes_verified += self._file_bytes(names)
        if found:
            more = f" (and {len(found) - 1} more problems)" if len(found) > 1 else ""
            raise CorruptCheckpointError(f"{self.path}: {found[0]}{more}; {CORRUPT_ADVICE}")

    def read(self, name: str, offsets=None, shape=None) -> torch.Tensor:
        """The region [offsets, offsets + shape) of array `name` (default: all of it), in its recorded dtype."""
        info = self._arrays[self._known([name])[0]]
        offsets = tuple(offsets) if offsets is not None else (0,) * len(info.shape)
        shape = tuple(shape) if shape is not None else tuple(g - o for g, o in zip(info.shape, offsets))
        if len(offsets) != len(info.shape) or len(shape) != len(info.shape) or any(
                o < 0 or s < 0 or o + s > g for o, s, g in zip(offsets, shape, info.shape)):
            raise ValueError(f"region offsets {offsets} shape {shape} lies outside array {name!r} of shape "
                             f"{info.shape}; ask for a region inside it")
        if math.prod(shape) == 0:
            return torch.empty(shape, dtype=info.dtype)
        array = self._open(name, info)
        fetched = self._check_chunk_sizes(name, info, offsets, shape)
        try:
            data = array[tuple(slice(o, o + s) for o, s in zip(offsets, shape))] if shape else array[...]
        except Exception as exc:  # zarr/numpy errors on damaged chunks
            raise CorruptCheckpointError(f"{self.path}: array {name!r}: reading {offsets}+{shape} failed ({exc}); "
                                         "run verify() and load an older checkpoint") from exc
        self.bytes_by_array[name] = self.bytes_by_array.get(name, 0) + fetched
        return numpy_to_tensor(data, info.dtype_name)

    def _file_bytes(self, names) -> int:
        """Bytes of the files verify(names) checksums, as the manifest lists them (names None: every file)."""
        listed = self.manifest["files"]
        if names is None:
            return sum(int(v.get("size", 0)) for v in listed.values())
        rels = ["metadata.json"]
        for name in names:
            info = self._arrays[name]
            rels += [f"{name}/zarr.json", *chunk_files(name, info.shape, info.chunks)]
        return sum(int(listed[r].get("size", 0)) for r in rels if r in listed)

    def _known(self, names):
        if names is None:
            return None
        names = list(names)
        unknown = [n for n in names if n not in self._arrays]
        if unknown:
            raise CheckpointError(f"{self.path}: no array named {unknown[0]!r} in this checkpoint; it holds "
                                  f"{len(self._arrays)} arrays, e.g. {sorted(self._arrays)[:5]}")
        return names

    def _open(self, name: str, info: ArrayInfo) -> zarr.Array:
        if name not in self._opened:
            check_array_json(self.path / name / "zarr.json", name, info.shape, info.dtype_name, info.chunks)
            self._opened[name] = zarr.open_array(store=str(self.path / name), mode="r", zarr_format=3)
        return self._opened[name]

    def _check_chunk_sizes(self, name, info: ArrayInfo, offsets, shape) -> int:
        """Every chunk the region touches must exist with exactly one chunk's bytes (what our writer wrote); returns
        the bytes of those chunks (what zarr fetches for the region)."""
        want = math.prod(info.chunks) * ITEMSIZE[info.dtype_name]
        ranges = [range(o // c, (o + s - 1) // c + 1) for o, s, c in zip(offsets, shape, info.chunks)]
        touched = 0
        for idx in itertools.product(*ranges):
            touched += 1
            rel = f"{name}/{chunk_key(idx)}"
            try:
                size = (self.path / rel).stat().st_size
            except FileNotFoundError:
                size = None
            if size != want:
                what = "missing" if size is None else f"{size} bytes, a chunk has {want}"
                raise CorruptCheckpointError(f"{self.path}: array {name!r}: chunk file {rel} {what}; "
                                             f"{CORRUPT_ADVICE}")
        return touched * want


def open_newest_valid(root, names=None, on_fallback: Callable[[str], object] | None = print) -> CheckpointReader:
    """The newest committed checkpoint under `root` whose files (of `names`, None: all) verify; each one skipped is
    reported through `on_fallback` with the reason. CheckpointError when none is usable."""
    root = Path(root)
    say = on_fallback or (lambda msg: None)
    latest = files.read_latest(root)
    candidates = find_checkpoints(root)
    if latest and all(p.name != latest for p in candidates):
        say(f"checkpoint {latest} (named by {root / 'latest'}) skipped: not a committed checkpoint")
    for path in candidates:
        try:
            reader = CheckpointReader(path)
            reader.verify(names)
            return reader
        except CheckpointError as exc:
            say(f"checkpoint {path.name} skipped: {exc}")
    raise CheckpointError(f"{root}: no valid committed checkpoint ({len(candidates)} tried); start from scratch "
                          "or restore a checkpoint directory")


def _checked_metadata(path: Path) -> dict:
    meta = load_json(path / "metadata.json", "metadata.json")
    if not isinstance(meta, dict) or meta.get("format") != files.FORMAT:
        raise CheckpointError(f"{path}: metadata.json is not a {files.FORMAT} file; give a directory written by "
                              "checkpoints.save")
    version = meta.get("schema_version")
    if version != files.SCHEMA_VERSION:
        raise CheckpointError(f"{path}: schema_version {version!r} is not supported (this code reads "
                              f"{files.SCHEMA_VERSION}); use the megaloop version that wrote it")
    arrays = meta.get("arrays")
    if not isinstance(meta.get("step"), int) or not isinstance(arrays, dict) or not all(
            _valid_array_entry(n, a) for n, a in arrays.items()):
        raise CorruptCheckpointError(f"{path}: metadata.json has a malformed step or arrays table; the checkpoint "
                                     "is damaged: load an older one")
    return meta


def _valid_array_entry(name, a) -> bool:
    try:
        validate_name(name)
    except ValueError:
        return False
    ok_ints = lambda v: isinstance(v, list) and all(isinstance(x, int) and x >= 0 for x in v)  # noqa: E731
    return (isinstance(a, dict) and a.get("dtype") in STORAGE_DTYPE and ok_ints(a.get("shape"))
            and ok_ints(a.get("chunks")) and len(a["shape"]) == len(a["chunks"]) and all(c > 0 for c in a["chunks"]))


def _checked_manifest(path: Path) -> dict:
    man = load_json(path / "manifest.json", "manifest.json")
    listed = man.get("files") if isinstance(man, dict) else None
    if (not isinstance(listed, dict) or man.get("algorithm") != files.HASH_ALGORITHM
            or not all(isinstance(v, dict) and ".." not in k.split("/") and not k.startswith("/")
                       for k, v in listed.items())):
        raise CorruptCheckpointError(f"{path}: manifest.json is malformed or uses an unknown checksum (expected "
                                     f"{files.HASH_ALGORITHM}); the checkpoint is damaged: load an older one")
    return man
