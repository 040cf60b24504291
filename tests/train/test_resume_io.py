"""Cheap resume (gloo, parcae-tiny, fp32): a checkpoint saved under data parallelism is restored through
RunCheckpoints.restore twice, with every rank reading everything it loads (share_reads=False) and with the replicated
state read once per data-parallel group (the default). The two give the same parameters and optimizer state bit for
bit (and the saved ones); the reader's byte counts equal what zarr fetched and what was checksummed; and the bytes
each rank read are those the array sizes predict: every parameter array (this rank's tensor-parallel shard of it)
read by exactly one rank of each data-parallel group, balanced within one array, and the optimizer state read once
per group where it is replicated (ZeRO stage 0) or each rank's own rows as before (ZeRO-1)."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
import torch

from benchmarks.resume_io import problems, run, split
from megaloop.train.resume_io import ResumeIO
from tests.pipeline.spawn import spawn

SMALL = ["model.vocab_size=512"]


def groups(figures: list) -> dict:
    """The data-parallel groups: ranks by tensor-parallel rank (pp 1)."""
    out = defaultdict(list)
    for f in figures:
        out[f["tp_rank"]].append(f)
    return out


def optim_of(by_array: dict) -> dict:
    """The optimizer-state arrays of a reader's per-array counts."""
    return {n: b for n, b in by_array.items() if not n.startswith("model/")}


def check_read_once_per_group(group: list, expected: dict) -> None:
    """Before: every rank of `group` read each array of `expected` with the bytes given there; after: exactly one
    rank did, the load of the ranks balanced within one array."""
    for name, nbytes in expected.items():
        assert all(f["before"]["by_array"][name] == nbytes for f in group), name
        assert sorted(f["after"]["by_array"].get(name, 0) for f in group) == [0] * (len(group) - 1) + [nbytes], name
    loads = [sum(f["after"]["by_array"].get(n, 0) for n in expected) for f in group]
    assert max(loads) <= sum(expected.values()) / len(group) + max(expected.values())


def check_common(figures: list) -> None:
    assert not problems(figures), problems(figures)  # bitwise states; reader counts equal zarr's and the checksums
    io = figures[0]["after"]["io"]
    assert isinstance(io, ResumeIO) and all(f["after"]["io"] == io for f in figures)
    for f in figures:  # the restore's figures are this rank's reader's counts
        params, optim = split(f["after"]["by_array"])
        assert (io.verified[f["rank"]], io.params[f["rank"]], io.optimizer[f["rank"]]) == (
            f["after"]["verified"], params, optim)
        assert f["before"]["start"] == f["after"]["start"] == 1
    # verification: one pass over the arrays' files (zarr.json and chunks), and metadata.json on every rank
    files, arrays = figures[0]["file_bytes"], figures[0]["array_bytes"]
    array_files = [size for rel, size in files.items() if any(rel.startswith(f"{name}/") for name in arrays)]
    assert sum(io.verified) == sum(array_files) + len(figures) * files["metadata.json"]
    tp = len(groups(figures))
    for f in figures:  # the parameters: this rank's shard of each (a 1/tp part of a split one, else all of it)
        assert all(b in (arrays[n], arrays[n] // tp) for n, b in f["param_bytes"].items())
        assert sorted(n for n in f["before"]["by_array"] if n.startswith("model/")) == sorted(f["param_bytes"])
    for group in groups(figures).values():
        check_read_once_per_group(group, group[0]["param_bytes"])


@pytest.mark.multiproc
@pytest.mark.parametrize("zero_stage", [1, 0])
def test_dp2_resume_reads_the_parameters_once_and_loads_the_same_state(zero_stage):
    figures = run(2, 1, zero_stage, overrides=SMALL)
    check_common(figures)
    optim = optim_of(figures[0]["before"]["by_array"])
    if zero_stage == 1:  # each rank's own rows and Muon matrices: read by it alone, as before
        for f in figures:
            assert optim_of(f["after"]["by_array"]) == optim_of(f["before"]["by_array"]) != {}
    else:  # replicated: every rank read all of it before, one rank of the group each array now
        check_read_once_per_group(figures, optim)
    before, after = (sum(sum(f[k]["by_array"].values()) for f in figures) for k in ("before", "after"))
    params = sum(figures[0]["param_bytes"].values())
    assert before - after == params + (sum(optim.values()) if zero_stage == 0 else 0)  # dp - 1 = 1 copy less


@pytest.mark.multiproc
def test_tp2_dp2_resume_reads_each_shard_once_per_data_parallel_group():
    figures = run(4, 2, 1, overrides=SMALL)
    check_common(figures)
    f0 = figures[0]
    halves = [n for n, b in f0["param_bytes"].items() if 2 * b == f0["array_bytes"][n]]
    assert halves and len(halves) < len(f0["param_bytes"])  # split parameters (a half each) and replicated ones
    for f in figures:  # ZeRO-1: each rank's own optimizer state, read by it alone as before
        assert optim_of(f["after"]["by_array"]) == optim_of(f["before"]["by_array"])


def test_resume_record_counts_one_verification_and_one_read_of_every_array(tiny_shards, tmp_path):
    """One process: the resume verifies every array's files once and reads every chunk once; the "resume" record
    carries that total, worked out here from the checkpoint's files on disk."""
    from checkpoints.load import CheckpointReader
    from megaloop.train.metrics import read_metrics
    from tests.train.test_checkpoint_resume import run as train_run

    train_run(tiny_shards, tmp_path, 2, "train.stop_at_step=1")
    train_run(tiny_shards, tmp_path, 2)
    step_dir = tmp_path / "checkpoints" / "step_00000001"
    arrays = CheckpointReader(step_dir).arrays
    sizes = {p.relative_to(step_dir).as_posix(): p.stat().st_size for p in step_dir.rglob("*") if p.is_file()}
    array_files = {rel: n for rel, n in sizes.items() if any(rel.startswith(f"{name}/") for name in arrays)}
    chunks = sum(n for rel, n in array_files.items() if not rel.endswith("zarr.json"))
    expected = sum(array_files.values()) + sizes["metadata.json"] + chunks
    [record] = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "resume"]
    assert record["step"] == 1
    assert record["bytes_read"] == record["bytes_read_max_rank"] == expected


ARRAYS = {"a": torch.arange(12.0).reshape(4, 3), "b": torch.arange(5.0) + 100, "c": -torch.eye(2),
          "d": torch.full((3,), 7.0)}  # float32: 48, 20, 16 and 12 bytes


def shared_reads_worker(rank: int, world: int, root: str) -> None:
    """DpSharedReader at dp 2 on arrays of a hand-made checkpoint: (shared) every rank asks for a, b, c in one order,
    rank 1 also for d; (own) the ranks ask in different orders; (failure) rank 1's reads fail."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from checkpoints import Checkpointer, CheckpointReader, Piece
    from checkpoints.errors import CheckpointError, CorruptCheckpointError
    from megaloop.train.resume_io import DpSharedReader
    from pipeline.layout import init_layout

    runtime = SimpleNamespace(layout=init_layout(dp=world), tp_rank=0, shard_spec=lambda name: None)
    if rank == 0:
        with Checkpointer(root, async_save=False) as ckpt:
            ckpt.save(1, [Piece(n, tuple(t.shape), (0,) * t.dim(), t) for n, t in ARRAYS.items()], {})
            assert ckpt.wait().ok
    dist.barrier()
    path, out = Path(root) / "step_00000001", {}

    def load(names, broken=False):
        reader = CheckpointReader(path)
        if broken:
            def fail(*args, **kwargs):
                raise CorruptCheckpointError("chunk damaged on purpose")
            reader.read = fail
        read = DpSharedReader(reader, runtime)
        with read.replicated([("read", n, n, True) for n in names]):
            got = {n: read(n, n, True) for n in names}
        return got, dict(reader.bytes_by_array)

    out["shared"] = load(["a", "b", "c"] + ["d"] * (rank == 1))
    out["own"] = load(["a", "b"] if rank == 0 else ["b", "a"])
    try:
        load(["a", "b", "c"], broken=rank == 1)
        out["failure"] = None
    except CheckpointError as exc:
        out["failure"] = (type(exc).__name__, str(exc))
    torch.save(out, Path(root) / f"{rank}.pt")


@pytest.mark.multiproc
def test_shared_reads_deal_arrays_by_bytes_fall_back_on_other_orders_and_fail_together(tmp_path):
    spawn(shared_reads_worker, 2, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"{rank}.pt") for rank in range(2))
    for rank, r in enumerate((r0, r1)):
        for case in ("shared", "own"):
            got, _ = r[case]
            assert all(torch.equal(t, ARRAYS[n]) for n, t in got.items()), (rank, case)
    # largest first to the least loaded: a (48 bytes) to rank 0, b (20) and c (16) to rank 1; d is rank 1's alone
    assert r0["shared"][1] == {"a": 48} and r1["shared"][1] == {"b": 20, "c": 16, "d": 12}
    assert r0["own"][1] == r1["own"][1] == {"a": 48, "b": 20}  # orders differ: each reads all it asks for
    assert r1["failure"] == ("CorruptCheckpointError", "chunk damaged on purpose")
    assert r0["failure"][0] == "CheckpointError" and "data-parallel rank 1" in r0["failure"][1]
    assert "chunk damaged on purpose" in r0["failure"][1]


def test_resume_line_states_totals_and_the_busiest_rank():
    io = ResumeIO(verified=(1024, 3 * 2 ** 20), params=(2 * 2 ** 20, 0), optimizer=(512, 512))
    assert io.per_rank == (1024 + 2 * 2 ** 20 + 512, 3 * 2 ** 20 + 512)
    assert io.describe() == ("read 5.0 MiB over 2 ranks (verifying 3.0 MiB, parameters 2.0 MiB, optimizer state "
                             "1.0 KiB), at most 3.0 MiB on one rank")
    assert io.as_record() == {"bytes_read": 1024 + 5 * 2 ** 20 + 1024, "bytes_read_max_rank": 3 * 2 ** 20 + 512}
