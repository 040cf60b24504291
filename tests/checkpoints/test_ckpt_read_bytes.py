"""The reader counts what it reads: the chunk files a region touches (whole chunks, as zarr fetches them) and the
files a verification checksums, against sizes worked out by hand and taken from the disk."""
import os

import torch
from ckpt_helpers import fast_write, grid_pieces

from checkpoints import Checkpointer, CheckpointReader, Piece


def saved(root):
    """A 6 x 10 float32 array in a 3 x 2 grid of pieces (chunks of 2 x 5: 40 bytes each), a 0-d int64, an empty."""
    pieces = grid_pieces("model/grid", torch.arange(60, dtype=torch.float32).reshape(6, 10), (3, 2))
    pieces += [Piece("optim/step", (), (), torch.tensor(7, dtype=torch.int64)),
               Piece("optim/empty", (0, 3), (0, 0), torch.zeros(0, 3))]
    with Checkpointer(root, async_save=False, file_writer=fast_write) as ckpt:
        ckpt.save(1, pieces, {})
        result = ckpt.wait()
    assert result.ok, result.error
    return result.path


def test_reads_count_the_whole_chunks_they_touch(tmp_path):
    reader = CheckpointReader(saved(tmp_path))
    assert reader.bytes_read == 0 and reader.bytes_verified == 0
    reader.read("model/grid", (1, 3), (4, 6))  # rows 1..4 touch chunk rows 0..2, columns 3..8 chunk columns 0..1
    assert reader.bytes_read == 3 * 2 * 40
    reader.read("model/grid", (2, 0), (2, 5))  # exactly one chunk
    reader.read("optim/step")  # one 8-byte chunk
    reader.read("optim/empty")  # no chunk at all
    assert reader.bytes_by_array == {"model/grid": 7 * 40, "optim/step": 8}
    assert reader.bytes_read == 7 * 40 + 8


def test_verification_counts_the_files_it_checksums(tmp_path):
    path = saved(tmp_path)
    size = lambda rel: os.path.getsize(path / rel)  # noqa: E731
    reader = CheckpointReader(path)
    reader.verify(["model/grid"])
    chunks = [os.path.join(d, f) for d, _, fs in os.walk(path / "model" / "grid" / "c") for f in fs]
    assert len(chunks) == 6 and all(os.path.getsize(c) == 40 for c in chunks)
    assert reader.bytes_verified == size("metadata.json") + size("model/grid/zarr.json") + 6 * 40
    whole = CheckpointReader(path)
    whole.verify()
    on_disk = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs
               if f not in ("COMMIT", "manifest.json")]
    assert whole.bytes_verified == sum(os.path.getsize(f) for f in on_disk)
