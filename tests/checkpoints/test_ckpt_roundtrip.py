"""One process saves pieces and reads them back: every dtype bit-exact, grids of pieces, sub-regions, metadata,
and the same arrays read with plain zarr (no project code)."""
import json

import numpy as np
import pytest
import torch
import zarr
from ckpt_helpers import bits, fast_write, grid_pieces

from checkpoints import Checkpointer, CheckpointReader, Piece, find_checkpoints

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8,
          torch.bool]


def sample(dtype, shape=(6, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
        t.view(-1)[:3] = torch.tensor([float("nan"), float("-inf"), -0.0], dtype=dtype)
        return t
    return torch.randint(0, 250, shape, generator=g).to(dtype)


def save_once(root, pieces, metadata=None, step=1):
    with Checkpointer(root, async_save=False, file_writer=fast_write) as ckpt:
        ckpt.save(step, pieces, metadata or {})
        result = ckpt.wait()
    assert result.ok, result.error
    return result


@pytest.fixture
def saved(tmp_path):
    """A checkpoint with every dtype, a 2-D array split 3x2, a 0-d and an empty array."""
    src = {f"model/{str(d).split('.')[1]}.weight": sample(d, seed=i) for i, d in enumerate(DTYPES)}
    src["model/grid.weight"] = torch.arange(6 * 10, dtype=torch.float32).reshape(6, 10)
    src["optim/step"] = torch.tensor(17, dtype=torch.int64)
    src["optim/empty"] = torch.zeros(0, 3)
    pieces = [Piece(n, tuple(t.shape), (0,) * t.dim(), t) for n, t in src.items() if n != "model/grid.weight"]
    pieces += grid_pieces("model/grid.weight", src["model/grid.weight"], (3, 2))
    meta = {"tokens": 123456, "layout": {"tp": 2, "dp": 1}, "rng": [1, 2, 3], "nested": {"a": [0.5, None, "x"]}}
    result = save_once(tmp_path, pieces, meta, step=42)
    return tmp_path, result, src, meta


def test_every_dtype_round_trips_bit_exact(saved):
    root, result, src, _ = saved
    reader = CheckpointReader(result.path)
    for name, t in src.items():
        got = reader.read(name)
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(bits(got), bits(t)), name
        assert reader.arrays[name].dtype == t.dtype


def test_grid_pieces_give_the_chunk_shape_and_subregions_read_back(saved):
    _, result, src, _ = saved
    reader = CheckpointReader(result.path)
    full = src["model/grid.weight"]
    assert reader.arrays["model/grid.weight"].chunks == (2, 5)
    for offsets, shape in [((1, 3), (4, 6)), ((0, 0), (6, 10)), ((5, 9), (1, 1)), ((2, 0), (2, 5))]:
        got = reader.read("model/grid.weight", offsets, shape)
        assert torch.equal(got, full[offsets[0]:offsets[0] + shape[0], offsets[1]:offsets[1] + shape[1]])
    with pytest.raises(ValueError, match="outside"):
        reader.read("model/grid.weight", (5, 0), (2, 10))


def test_metadata_round_trips_and_names_the_arrays(saved):
    _, result, src, meta = saved
    reader = CheckpointReader(result.path)
    assert reader.step == 42
    assert {k: reader.metadata[k] for k in meta} == meta
    assert reader.metadata["format"] == "megaloop-checkpoint" and reader.metadata["schema_version"] == 1
    assert set(reader.metadata["arrays"]) == set(src)
    assert reader.metadata["arrays"]["model/bfloat16.weight"]["dtype"] == "bfloat16"
    assert find_checkpoints(result.path.parent) == [result.path]
    assert (result.path.parent / "latest").read_text().strip() == result.path.name


def test_plain_zarr_reads_every_array(saved):
    _, result, src, _ = saved
    group = zarr.open_group(str(result.path), mode="r")
    for name, t in src.items():
        arr = group[name]
        assert arr.attrs["torch_dtype"] == str(t.dtype).removeprefix("torch.")
        data = np.asarray(arr[...])
        want = t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()
        assert data.dtype == want.dtype and data.shape == want.shape, name
        assert data.tobytes() == want.tobytes(), name
        assert json.loads((result.path / name / "zarr.json").read_text())["codecs"][0]["name"] == "bytes"


def test_bad_names_and_reserved_metadata_are_refused(tmp_path):
    t = torch.zeros(2)
    for bad in ["", "a//b", "../x", "a/../b", "__hidden/x", "manifest.json", "a/zarr.json", "a b"]:
        with pytest.raises(ValueError, match="invalid checkpoint array name"):
            save_once(tmp_path, [Piece(bad, (2,), (0,), t)])
    with pytest.raises(ValueError, match="reserved"):
        save_once(tmp_path, [Piece("x", (2,), (0,), t)], {"step": 3})
    with pytest.raises(ValueError, match="lies inside array"):
        save_once(tmp_path, [Piece("a", (2,), (0,), t), Piece("a/b", (2,), (0,), t)])
    assert find_checkpoints(tmp_path) == []


def test_plain_zarr_walks_a_checkpoint_without_warnings(saved):
    """metadata.json, manifest.json and COMMIT sit beside the arrays: plain zarr must not warn about them."""
    import warnings

    _, result, src, _ = saved
    found = []

    def walk(group, prefix=""):
        for name, member in group.members():
            if isinstance(member, zarr.Group):
                walk(member, f"{prefix}{name}/")
            else:
                found.append(f"{prefix}{name}")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        walk(zarr.open_group(str(result.path), mode="r"))
    assert sorted(found) == sorted(src)
