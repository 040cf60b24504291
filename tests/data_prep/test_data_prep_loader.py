"""The loader: epoch coverage per dp, dp-independent global batches, exact resume, prefetch."""
from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from data_prep.errors import DataPrepError, ResumeStateError
from data_prep.loader import ShardLoader, validation_batches
from data_prep.order import RowPermutation, rows_at
from data_prep.shard_reader import ShardDataset

from dp_testing import SEQ_LEN

GLOBAL_BATCH = 12


def _global_batch(shard_dir, step, dp, seed=0):
    """Global batch `step` assembled from the shares of all dp ranks (rank order)."""
    parts = [ShardLoader(shard_dir, GLOBAL_BATCH, r, dp, seed=seed, prefetch=0).batch(step) for r in range(dp)]
    return {k: torch.cat([p[k] for p in parts]) for k in ("tokens", "sample_index", "row_id", "epoch")}


def _stream(loader, steps):
    return [b for b in itertools.islice(loader, steps)]


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_one_epoch_sees_every_row_exactly_once(small_shards, dp):
    seen = []
    for rank in range(dp):
        loader = ShardLoader(small_shards, GLOBAL_BATCH, rank, dp, seed=3)
        n_rows = loader.num_rows
        for batch in _stream(loader, -(-n_rows // GLOBAL_BATCH)):
            assert batch["tokens"].dtype == torch.int64 and batch["tokens"].shape == (GLOBAL_BATCH // dp, SEQ_LEN + 1)
            in_epoch = batch["sample_index"] < n_rows
            assert (batch["epoch"][in_epoch] == 0).all() and (batch["epoch"][~in_epoch] == 1).all()
            seen += batch["row_id"][in_epoch].tolist()
        loader.close()
    assert n_rows > 1000 and n_rows % GLOBAL_BATCH != 0   # an epoch ends inside a batch: the hard case
    assert sorted(seen) == list(range(n_rows))


def test_tokens_are_the_rows_named_by_row_id(small_shards):
    dataset = ShardDataset(small_shards)
    batch = ShardLoader(small_shards, GLOBAL_BATCH, 1, 2, seed=5).batch(41)
    assert np.array_equal(batch["tokens"].numpy(), dataset.read_rows(batch["row_id"].numpy()).astype(np.int64))
    assert batch["sample_index"].tolist() == list(range(41 * GLOBAL_BATCH + 6, 42 * GLOBAL_BATCH))


def test_global_batch_is_the_same_for_every_dp(small_shards):
    n_rows = ShardDataset(small_shards).__len__()
    boundary_step = n_rows // GLOBAL_BATCH                 # the batch that straddles epochs 0 and 1
    for step in (0, 1, 17, boundary_step, boundary_step + 3):
        reference = _global_batch(small_shards, step, 1)
        assert reference["sample_index"].tolist() == list(range(step * GLOBAL_BATCH, (step + 1) * GLOBAL_BATCH))
        for dp in (2, 3, 4):
            other = _global_batch(small_shards, step, dp)
            for key in reference:
                assert torch.equal(reference[key], other[key]), (step, dp, key)


def test_order_depends_on_seed_and_epoch_only(small_shards):
    a = _global_batch(small_shards, 0, 1, seed=0)["row_id"]
    assert not torch.equal(a, _global_batch(small_shards, 0, 1, seed=1)["row_id"])
    n_rows = ShardDataset(small_shards).__len__()
    epoch0, _ = rows_at(np.arange(0, n_rows), n_rows, seed=0)
    epoch1, _ = rows_at(np.arange(n_rows, 2 * n_rows), n_rows, seed=0)
    assert sorted(epoch0) == sorted(epoch1) == list(range(n_rows)) and not np.array_equal(epoch0, epoch1)


@pytest.mark.parametrize("prefetch", [0, 3])
def test_stop_and_resume_continues_the_identical_stream(small_shards, prefetch):
    uninterrupted = _stream(ShardLoader(small_shards, GLOBAL_BATCH, 1, 3, seed=9, prefetch=prefetch), 20)
    first = ShardLoader(small_shards, GLOBAL_BATCH, 1, 3, seed=9, prefetch=prefetch)
    for count, _ in enumerate(first, start=1):
        if count == 7:
            break
    state = first.state_dict()
    first.close()
    assert state["step"] == 7 and state["position"] == 7 * GLOBAL_BATCH
    resumed = ShardLoader(small_shards, GLOBAL_BATCH, 1, 3, seed=9, prefetch=prefetch)
    resumed.load_state_dict(state)
    for expected, got in zip(uninterrupted[7:], _stream(resumed, 13)):
        assert expected["step"] == got["step"]
        for key in ("tokens", "sample_index", "row_id"):
            assert torch.equal(expected[key], got[key])
    assert resumed.state_dict()["step"] == 20


def test_resume_under_another_dp_size_continues_the_stream(small_shards):
    n_rows = ShardDataset(small_shards).__len__()
    stop = n_rows // GLOBAL_BATCH - 2                  # resume just before the epoch boundary
    saved = []
    for rank in range(2):
        loader = ShardLoader(small_shards, GLOBAL_BATCH, rank, 2, seed=4)
        loader.load_state_dict({**loader.state_dict(), "step": stop - 5})
        _stream(loader, 5)
        saved.append(loader.state_dict())
        loader.close()
    assert saved[0] == saved[1] and saved[0]["step"] == stop
    for step in range(stop, stop + 5):
        shares = []
        for rank in range(4):
            loader = ShardLoader(small_shards, GLOBAL_BATCH, rank, 4, seed=4, prefetch=0)
            loader.load_state_dict(saved[0])
            shares.append(_stream(loader, step - stop + 1)[-1])
        combined = torch.cat([s["row_id"] for s in shares])
        assert torch.equal(combined, _global_batch(small_shards, step, 1, seed=4)["row_id"])


def test_state_from_another_setup_is_refused(small_shards):
    state = ShardLoader(small_shards, GLOBAL_BATCH, seed=1).state_dict()
    with pytest.raises(ResumeStateError, match="global_batch_size.*What to do"):
        ShardLoader(small_shards, 2 * GLOBAL_BATCH, seed=1).load_state_dict(state)
    with pytest.raises(ResumeStateError, match="seed"):
        ShardLoader(small_shards, GLOBAL_BATCH, seed=2).load_state_dict(state)


def test_bad_layout_is_refused(small_shards):
    with pytest.raises(DataPrepError, match="not a positive multiple of dp size 5"):
        ShardLoader(small_shards, GLOBAL_BATCH, 0, 5)
    with pytest.raises(DataPrepError, match="dp_rank 4"):
        ShardLoader(small_shards, GLOBAL_BATCH, 4, 4)


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_validation_batches_cover_the_split_in_fixed_order(small_shards, dp):
    n_val = ShardDataset(small_shards, "val").__len__()
    per_rank = [list(validation_batches(small_shards, 8, r, dp)) for r in range(dp)]
    assert len({len(batches) for batches in per_rank}) == 1 and len(per_rank[0]) == -(-n_val // 8)
    order = []
    for step in range(len(per_rank[0])):
        for rank in range(dp):
            batch = per_rank[rank][step]
            assert batch["tokens"].shape == (8 // dp, SEQ_LEN + 1)
            order += batch["row_id"][batch["valid"]].tolist()
            assert (batch["row_id"][~batch["valid"]] == -1).all()
    assert order == list(range(n_val))


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5000), seed=st.integers(0, 2**63), epoch=st.integers(0, 1000))
def test_row_permutation_is_a_bijection(n, seed, epoch):
    image = RowPermutation(n, seed, epoch)(np.arange(n))
    assert np.array_equal(np.sort(image), np.arange(n))


def _odd_even(rank):
    """A pure selection: rank 0 reads the global batch's even positions in reverse, rank 1 the odd ones."""
    def select(step, sample_indices):
        mine = np.flatnonzero(sample_indices % 2 == rank)
        return mine[::-1] if rank == 0 else mine
    return select


@pytest.mark.parametrize("prefetch", [0, 2])
def test_select_reads_the_chosen_positions_and_resumes(small_shards, prefetch):
    full = [_global_batch(small_shards, step, 1, seed=6) for step in range(6)]
    loaders = [ShardLoader(small_shards, GLOBAL_BATCH, r, 2, seed=6, prefetch=prefetch, select=_odd_even(r))
               for r in range(2)]
    first = [_stream(loader, 3) for loader in loaders]
    states = [loader.state_dict() for loader in loaders]
    for loader in loaders:
        loader.close()
    resumed = []
    for r in range(2):
        loader = ShardLoader(small_shards, GLOBAL_BATCH, r, 2, seed=6, prefetch=prefetch, select=_odd_even(r))
        loader.load_state_dict(states[r])
        resumed.append(_stream(loader, 3))
        loader.close()
    for step in range(6):
        parts = [(first[r] + resumed[r])[step] for r in range(2)]
        expected = full[step]
        for r, part in enumerate(parts):
            want = np.flatnonzero(expected["sample_index"].numpy() % 2 == r)
            want = want[::-1].copy() if r == 0 else want
            for key in ("tokens", "sample_index", "row_id"):
                assert torch.equal(part[key], expected[key][torch.from_numpy(want)])


def test_bad_selection_is_refused(small_shards):
    loader = ShardLoader(small_shards, GLOBAL_BATCH, seed=1, prefetch=0, select=lambda step, idx: [0, 0])
    with pytest.raises(DataPrepError, match="distinct positions"):
        loader.batch(0)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_pin_memory_pins_the_tokens_where_the_batch_is_made(small_shards, prefetch, monkeypatch):
    """pin_memory=True pins each yielded batch's tokens, in the prefetch thread when there is one (pinning needs
    CUDA: Tensor.pin_memory is replaced by a marked copy that records the thread); the stream is unchanged."""
    threads = []

    def pin_memory(self, device=None):
        threads.append(threading.current_thread().name)
        pinned = self.clone()
        pinned.pinned_for_test = True
        return pinned

    plain = list(itertools.islice(iter(ShardLoader(small_shards, 8, prefetch=prefetch)), 3))
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    loader = ShardLoader(small_shards, 8, prefetch=prefetch, pin_memory=True)
    pinned = list(itertools.islice(iter(loader), 3))
    loader.close()
    assert all(getattr(b["tokens"], "pinned_for_test", False) for b in pinned)
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(plain, pinned))
    maker = "data_prep-prefetch" if prefetch else threading.main_thread().name
    assert len(threads) >= 3 and set(threads) == {maker}


def test_ranks_that_disagree_on_a_corrupt_shard_agree_on_one_set_of_rows(small_shards, tmp_path):
    """on_corrupt='skip' where rank 0's copy of a shard is damaged and rank 1's is not (a node's copy, a read
    error): after agree_skipped with the union of their skips, both leave it out, so the global batch is the one a
    job whose every copy was damaged reads; without the agreement the ranks index different row sets."""
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(small_shards, damaged)
    shard = sorted(damaged.glob("train-*.tar"))[1]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 512)

    def loaders(dirs):
        return [ShardLoader(d, GLOBAL_BATCH, rank, 2, seed=3, prefetch=0, on_corrupt="skip")
                for rank, d in enumerate(dirs)]

    reference = loaders([damaged, damaged])
    mixed = loaders([damaged, small_shards])
    assert [loader.num_rows for loader in mixed][0] < mixed[1].num_rows  # they disagree before agreeing
    union = sorted({x for loader in mixed for x in loader.skipped_names()})
    assert union == [(0, shard.name)]
    assert [loader.agree_skipped(union) for loader in mixed] == [0, 1]
    for step in (0, 5, 40):
        ours = torch.cat([loader.batch(step)["row_id"] for loader in mixed])
        theirs = torch.cat([loader.batch(step)["row_id"] for loader in reference])
        assert torch.equal(ours, theirs), step
    assert mixed[1].skipped[0]["shard"] == shard.name and "another rank" in mixed[1].skipped[0]["problem"]
