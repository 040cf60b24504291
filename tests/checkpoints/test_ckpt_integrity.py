"""Damage and failure: flipped or truncated chunks are found and named by array, loading falls back to the previous
committed checkpoint, a full disk mid-save leaves `latest` alone, retention keeps `keep`, async saves snapshot."""
import errno
import threading
import time

import pytest
import torch
from ckpt_helpers import fast_write

from checkpoints import (Checkpointer, CheckpointReader, CorruptCheckpointError, Piece, find_checkpoints,
                         open_newest_valid)


def pieces(value: float = 0.0):
    w = torch.arange(32, dtype=torch.float32).reshape(8, 4) + value
    return [Piece("model/w", (8, 4), (0, 0), w[:4]), Piece("model/w", (8, 4), (4, 0), w[4:]),
            Piece("model/b", (4,), (0,), torch.full((4,), value).bfloat16())]


def save_steps(root, steps, keep=10, **kw):
    with Checkpointer(root, keep=keep, async_save=False, file_writer=kw.pop("file_writer", fast_write), **kw) as c:
        for step in steps:
            c.save(step, pieces(step), {"tokens": step * 100})
            assert c.wait().ok, c.wait().error
    return [root / f"step_{s:08d}" for s in steps]


def flip_byte(path, at=5):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_flipped_byte_is_found_and_names_the_array(tmp_path):
    (ckpt,) = save_steps(tmp_path, [1])
    flip_byte(ckpt / "model/w/c/1/0")
    reader = CheckpointReader(ckpt)
    with pytest.raises(CorruptCheckpointError, match=r"array 'model/w': model/w/c/1/0: checksum mismatch"):
        reader.verify()
    reader.verify(["model/b"])                       # the other array is intact
    with pytest.raises(CorruptCheckpointError, match="model/w"):
        reader.verify(["model/w"])


def test_truncated_missing_and_unlisted_files_are_found(tmp_path):
    (ckpt,) = save_steps(tmp_path, [1])
    chunk = ckpt / "model/w/c/0/0"
    chunk.write_bytes(chunk.read_bytes()[:-3])
    reader = CheckpointReader(ckpt)
    with pytest.raises(CorruptCheckpointError, match=r"array 'model/w': model/w/c/0/0: truncated"):
        reader.verify()
    with pytest.raises(CorruptCheckpointError, match=r"array 'model/w': chunk file model/w/c/0/0 61 bytes"):
        reader.read("model/w")
    assert torch.equal(reader.read("model/w", (4, 0), (4, 4)), pieces(1)[1].tensor)  # untouched chunk still reads
    (ckpt / "model/b/c/0").unlink()
    (ckpt / "model/b/c/9").write_bytes(b"x")
    problems = reader.problems()
    assert any("'model/b': model/b/c/0: file missing" in p for p in problems), problems
    assert any("'model/b': model/b/c/9: on disk but not in manifest.json" in p for p in problems), problems


def test_loading_falls_back_to_the_previous_committed_checkpoint(tmp_path):
    paths = save_steps(tmp_path, [1, 2, 3])
    assert find_checkpoints(tmp_path) == paths[::-1]
    flip_byte(paths[2] / "model/b/c/0", at=1)
    skipped = []
    reader = open_newest_valid(tmp_path, on_fallback=skipped.append)
    assert reader.step == 2 and reader.metadata["tokens"] == 200
    assert len(skipped) == 1 and "step_00000003" in skipped[0] and "'model/b'" in skipped[0]
    assert torch.equal(reader.read("model/w"), torch.arange(32.0).reshape(8, 4) + 2)
    # `latest` names a directory that is gone: the newest committed one is used, and said so
    (tmp_path / "latest").write_text("step_00000009\n")
    skipped.clear()
    assert open_newest_valid(tmp_path, names=["model/w"], on_fallback=skipped.append).step == 3
    assert "step_00000009" in skipped[0]


def test_full_disk_mid_save_keeps_latest_and_reports_the_file(tmp_path):
    save_steps(tmp_path, [1])
    calls = []

    def full_disk(path, data):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        fast_write(path, data)

    with Checkpointer(tmp_path, async_save=True, file_writer=full_disk) as c:
        c.save(2, pieces(2), {})
        result = c.wait()
    assert not result.ok and result.step == 2
    assert "No space left on device" in result.error and "(array 'model/" in result.error
    assert "c/" in result.error                                 # the chunk file is named
    assert (tmp_path / "latest").read_text().strip() == "step_00000001"
    assert find_checkpoints(tmp_path) == [tmp_path / "step_00000001"]
    open_newest_valid(tmp_path, on_fallback=pytest.fail).verify()
    assert [p.name.split(".")[1][:3] for p in tmp_path.glob("step_00000002.*")] == ["tmp"]
    save_steps(tmp_path, [3])                                   # the next commit removes the failed attempt
    assert not list(tmp_path.glob("*.tmp-*"))


def test_retention_keeps_exactly_keep(tmp_path):
    save_steps(tmp_path, [10, 20, 30], keep=2)
    (tmp_path / "latest.tmp-1-2").write_text("step_00000010\n")   # as left by a crash
    (tmp_path / "step_00000035.tmp-abc123").mkdir()
    save_steps(tmp_path, [40, 50], keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000040", "step_00000050"]
    save_steps(tmp_path, [50], keep=2)                          # saving a step again replaces it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000040", "step_00000050"]


def test_async_save_returns_before_writing_and_snapshots_the_data(tmp_path):
    release, started = threading.Event(), threading.Event()

    def blocked(path, data):
        started.set()
        assert release.wait(30)
        fast_write(path, data)

    src = pieces(5)
    expected = [p.tensor.clone() for p in src]
    with Checkpointer(tmp_path, file_writer=blocked) as c:
        t0 = time.perf_counter()
        c.save(7, src, {"tokens": 1})
        assert started.wait(30)
        assert not (tmp_path / "latest").exists()               # save() returned, nothing committed yet
        for p in src:
            p.tensor.fill_(-1)                                   # training goes on and changes its tensors
        release.set()
        result = c.wait()
        assert result.ok and result.stall_s < time.perf_counter() - t0
    reader = CheckpointReader(result.path)
    assert torch.equal(reader.read("model/w"), torch.cat(expected[:2]))
    assert torch.equal(reader.read("model/b"), expected[2])


def test_failed_results_are_queued_not_lost(tmp_path):
    def broken(path, data):
        raise OSError(errno.EIO, "Input/output error")

    with Checkpointer(tmp_path, file_writer=broken) as c:
        c.save(1, pieces(), {})
        c.file_writer = fast_write
        c.save(2, pieces(), {})
        c.wait()
        results = c.take_results()
    assert [(r.step, r.ok) for r in results] == [(1, False), (2, True)]
    assert "Input/output error" in results[0].error


def test_corrupt_checkpoint_advice_is_followed(tmp_path, capsys):
    """The error names what a user can do (an older step directory; verify --all shows which), and doing it works."""
    from checkpoints.cli import main

    with Checkpointer(tmp_path, async_save=False, file_writer=fast_write) as saver:
        for step in (1, 2):
            saver.save(step, pieces(step), {"config": {"model": {}}, "tokens": step * 100})
            assert saver.wait().ok
    flip_byte(tmp_path / "step_00000002" / "model/w/c/1/0")
    assert main(["export", str(tmp_path), "--out", str(tmp_path / "w.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "open_newest_valid" not in err and "give an older step_XXXXXXXX directory" in err, err
    assert main(["verify", str(tmp_path), "--all"]) != 0
    listed = capsys.readouterr().out
    assert "CORRUPT" in listed and f"OK {tmp_path / 'step_00000001'}" in listed, listed
    assert main(["export", str(tmp_path / "step_00000001"), "--out", str(tmp_path / "w.safetensors")]) == 0
    assert (tmp_path / "w.safetensors").is_file()
