"""A checkpoint carrying a pickle where JSON or raw bytes are expected is refused without executing it, even when
an attacker also rewrote manifest.json so that sizes and checksums match."""
import json
import pickle
import zlib

import pytest
import torch
from ckpt_helpers import fast_write

from checkpoints import Checkpointer, CheckpointError, CheckpointReader, Piece, open_newest_valid


class Sentinel:
    """Unpickling this creates the file at `path`."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def ckpt(tmp_path):
    root = tmp_path / "ckpts"
    with Checkpointer(root, async_save=False, file_writer=fast_write) as c:
        c.save(1, [Piece("model/w", (8, 8), (0, 0), torch.ones(8, 8))], {"tokens": 1})
        assert c.wait().ok
    return root / "step_00000001", tmp_path / "PWNED"


def plant(path, rel, payload: bytes):
    """Replace a file and rewrite the manifest so that its size and checksum match."""
    (path / rel).write_bytes(payload)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][rel] = {"size": len(payload), "crc32": f"{zlib.crc32(payload):08x}"}
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_pickled_metadata_is_refused(ckpt):
    path, sentinel = ckpt
    plant(path, "metadata.json", pickle.dumps(Sentinel(sentinel)))
    with pytest.raises(CheckpointError, match="metadata.json is not JSON .*looks like a pickle"):
        CheckpointReader(path)
    with pytest.raises(CheckpointError, match="no valid committed checkpoint"):
        open_newest_valid(path.parent, on_fallback=None)
    assert not sentinel.exists()


def test_pickled_chunk_is_refused_or_read_as_plain_bytes(ckpt):
    path, sentinel = ckpt
    payload = pickle.dumps(Sentinel(sentinel))
    plant(path, "model/w/c/0/0", payload)
    reader = CheckpointReader(path)
    with pytest.raises(CheckpointError, match="model/w/c/0/0: manifest.json lists .* bytes but a chunk"):
        reader.verify()
    with pytest.raises(CheckpointError, match="chunk file model/w/c/0/0"):
        reader.read("model/w")
    assert len(payload) < 256
    padded = payload.ljust(256, b".")
    plant(path, "model/w/c/0/0", padded)                         # exactly one chunk's size: mere numbers
    reader = CheckpointReader(path)
    reader.verify()
    assert reader.read("model/w").shape == (8, 8)
    assert not sentinel.exists()


def test_pickled_zarr_json_is_refused(ckpt):
    path, sentinel = ckpt
    plant(path, "model/w/zarr.json", pickle.dumps(Sentinel(sentinel)))
    reader = CheckpointReader(path)
    with pytest.raises(CheckpointError, match="zarr.json of array 'model/w' is not JSON"):
        reader.verify()
    with pytest.raises(CheckpointError, match="model/w"):
        reader.read("model/w")
    assert not sentinel.exists()


@pytest.mark.parametrize("change", [
    {"codecs": [{"name": "numcodecs.pickle"}]},
    {"data_type": "object"},
    {"attributes": {"torch_dtype": "object"}},
    {"codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "gzip"}]},
])
def test_zarr_json_with_other_codecs_or_dtypes_is_refused(ckpt, change):
    path, sentinel = ckpt
    meta = json.loads((path / "model/w/zarr.json").read_text())
    meta.update(change)
    plant(path, "model/w/zarr.json", json.dumps(meta).encode())
    reader = CheckpointReader(path)
    with pytest.raises(CheckpointError, match="array 'model/w' refused"):
        reader.read("model/w")
    assert any("refused" in p for p in reader.problems())
    assert not sentinel.exists()
