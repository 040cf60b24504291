"""Four ranks (threads with a barrier-based all_gather_object) save one checkpoint: a tensor-parallel array is
written by the two ranks that split it, replicas by exactly one rank, and the result equals the global tensors."""
import threading

import pytest
import torch
from ckpt_helpers import CountingWriter, fast_write, run_ranks

from checkpoints import Checkpointer, CheckpointError, CheckpointReader, Piece, find_checkpoints, wait_committed

WORLD = 4  # tp = 2 (rank % 2), dp = 2 (rank // 2)


def global_tensors():
    g = torch.Generator().manual_seed(1)
    return {"model/w": torch.randn(8, 6, generator=g),                      # split by rows over tp
            "model/norm": torch.randn(6, generator=g).bfloat16(),            # replicated on all 4 ranks
            "optim/adam/exp_avg/w": torch.randn(8, 6, generator=g),          # split over tp, dp replicas
            "optim/muon/momentum/x": torch.randn(3, 3, generator=g)}         # held by ranks 2 and 3 only


def pieces_of(rank, full):
    tp = rank % 2
    rows = slice(4 * tp, 4 * tp + 4)
    out = [Piece("model/w", (8, 6), (4 * tp, 0), full["model/w"][rows]),
           Piece("model/norm", (6,), (0,), full["model/norm"]),
           Piece("optim/adam/exp_avg/w", (8, 6), (4 * tp, 0), full["optim/adam/exp_avg/w"][rows])]
    if rank >= 2:
        out.append(Piece("optim/muon/momentum/x", (3, 3), (0, 0), full["optim/muon/momentum/x"]))
    return out


def test_four_ranks_write_each_region_once(tmp_path):
    full = global_tensors()
    writers = [CountingWriter() for _ in range(WORLD)]

    def rank_main(rank, gather):
        with Checkpointer(tmp_path, rank=rank, world_size=WORLD, all_gather_object=gather,
                          file_writer=writers[rank], commit_timeout_s=60) as ckpt:
            ckpt.save(10, pieces_of(rank, full), {"tokens": 99} if rank == 0 else {"ignored": True})
            result = ckpt.wait()
        wait_committed(tmp_path, 10, timeout_s=60, token=result.token)
        return result

    results = run_ranks(WORLD, rank_main)
    assert all(r.ok for r in results), [r.error for r in results]
    assert len({r.token for r in results}) == 1
    paths = [p for w in writers for p in w.paths]
    assert len(paths) == len(set(paths)) == 2 + 1 + 2 + 1        # every chunk file written once
    total = sum(t.numel() * t.element_size() for t in full.values())
    assert sum(r.bytes_written for r in results) == sum(w.nbytes for w in writers) == total
    assert all(r.bytes_written > 0 for r in results)              # the replicas were spread over all ranks
    reader = CheckpointReader(results[0].path)
    reader.verify()
    assert reader.metadata["tokens"] == 99 and "ignored" not in reader.metadata
    assert reader.arrays["model/w"].chunks == (4, 6)
    for name, t in full.items():
        assert torch.equal(reader.read(name), t), name


def test_non_tiling_declaration_raises_on_every_rank(tmp_path):
    def rank_main(rank, gather):
        start = [0, 3, 4, 6][rank]          # 4 equal blocks of 2 rows, but rank 1 starts at row 3
        with Checkpointer(tmp_path, rank=rank, world_size=WORLD, all_gather_object=gather) as ckpt:
            ckpt.save(1, [Piece("model/bad", (8,), (start,), torch.zeros(2))], {})

    results = run_ranks(WORLD, rank_main)
    assert all(isinstance(r, ValueError) and "array 'model/bad'" in str(r) for r in results), results
    assert not list(tmp_path.iterdir())


def test_a_bad_piece_on_one_rank_stops_every_rank(tmp_path):
    def rank_main(rank, gather):
        dtype = torch.complex64 if rank == 3 else torch.float32
        with Checkpointer(tmp_path, rank=rank, world_size=WORLD, all_gather_object=gather) as ckpt:
            ckpt.save(1, [Piece("x", (2,), (0,), torch.zeros(2, dtype=dtype))], {})

    results = run_ranks(WORLD, rank_main)
    assert all(isinstance(r, ValueError) and "rank 3" in str(r) for r in results), results


def test_world_size_needs_a_gather(tmp_path):
    with pytest.raises(ValueError, match="all_gather_object"):
        Checkpointer(tmp_path, rank=0, world_size=2)


def test_a_failing_rank_aborts_the_commit_and_every_rank_hears_of_it(tmp_path):
    full = global_tensors()

    def full_disk(path, data):
        raise OSError(28, "No space left on device")

    def rank_main(rank, gather):
        with Checkpointer(tmp_path, rank=rank, world_size=WORLD, all_gather_object=gather,
                          file_writer=fast_write, commit_timeout_s=60) as ckpt:
            ckpt.save(1, pieces_of(rank, full), {})
            assert ckpt.wait().ok
            if rank == 2:
                ckpt.file_writer = full_disk
            ckpt.save(2, pieces_of(rank, full), {})
            result = ckpt.wait()
        try:
            wait_committed(tmp_path, 2, timeout_s=60, token=result.token)
        except CheckpointError as exc:
            return result, str(exc)
        return result, None

    out = run_ranks(WORLD, rank_main)
    assert not any(isinstance(o, BaseException) for o in out), out
    results, heard = zip(*out)
    assert not results[0].ok and "rank 2 failed" in results[0].error and "No space left" in results[0].error
    assert not results[2].ok and "(array '" in results[2].error
    assert all(h and "aborted" in h for h in heard), heard
    assert (tmp_path / "latest").read_text().strip() == "step_00000001"
    assert find_checkpoints(tmp_path) == [tmp_path / "step_00000001"]


def test_a_rank_that_never_finishes_times_the_commit_out(tmp_path):
    release = threading.Event()

    def stuck(path, data):
        assert release.wait(60)
        fast_write(path, data)

    def rank_main(rank, gather):
        ckpt = Checkpointer(tmp_path, rank=rank, world_size=2, all_gather_object=gather, commit_timeout_s=0.5,
                            file_writer=stuck if rank == 1 else fast_write)
        ckpt.save(3, [Piece("w", (4,), (2 * rank,), torch.zeros(2))], {})
        if rank == 0:
            result = ckpt.close()
            release.set()
            return result
        return ckpt.close()

    results = run_ranks(2, rank_main)
    assert not results[0].ok and "ranks [1] did not finish" in results[0].error, results[0]
    assert find_checkpoints(tmp_path) == []


@pytest.mark.parametrize("told", [False, True])
def test_rank0_lists_the_staging_directory_once_a_second_and_at_once_when_told(tmp_path, monkeypatch, told):
    """Rank 0's commit looks for the other ranks' parts once a second (not in a burst of quick polls: at 128 ranks
    on a shared file system every listing counts); when a collective says every part is written (`wait`'s
    all_written, here a thread barrier), it looks at once instead of at its next poll."""
    import os
    import sys
    import time

    import checkpoints.commit as commit_module

    listings, real_scandir = [], os.scandir

    def scandir(path="."):
        if sys._getframe(1).f_code.co_name == "all_in":  # the commit's look for the parts
            listings.append(time.monotonic())
        return real_scandir(path)

    monkeypatch.setattr(commit_module.os, "scandir", scandir)
    barrier = threading.Barrier(2)

    def slow_write(path, data):
        time.sleep(1.3)
        fast_write(path, data)

    def rank_main(rank, gather):
        with Checkpointer(tmp_path, rank=rank, world_size=2, all_gather_object=gather, commit_timeout_s=60,
                          file_writer=slow_write if rank == 1 else fast_write) as ckpt:
            ckpt.save(5, [Piece("x", (4,), (2 * rank,), torch.arange(2.0) + rank)], {})
            return ckpt.wait(barrier.wait if told else None)

    results = run_ranks(2, rank_main)
    assert all(r.ok for r in results), [r.error for r in results]
    gaps = [b - a for a, b in zip(listings, listings[1:])]
    print(f"told={told}: {len(listings)} listings, gaps {[round(g, 2) for g in gaps]} s")
    assert all(g >= 0.9 for g in gaps[:-1])          # the scheduled polls: one a second
    if told:
        assert gaps[-1] < 0.85                         # the last look came from the barrier, not the schedule
    else:
        assert gaps[-1] >= 0.9 and len(listings) <= 3  # 1.3 s of waiting: looks at 0, 1 and 2 s
