"""Checkpoint bytes per rank under ZeRO-1 at dp2 (gloo, parcae-tiny, small owner-written moment chunks): a save
gathers no optimizer moments (old code: an all-gather of all of them), and a resume reads no more than the rank's
parameters, its Muon state and its 1/dp of the AdamW moments, plus the partial chunks at the two ends of its range
(old code: every moment). The loaded state equals the saved one bit for bit on every rank."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.checkpoint_bytes import report, run

TINY = Path(__file__).resolve().parents[2] / "configs" / "parcae-tiny.yaml"
BLOCK_KIB = 8


@pytest.mark.multiproc
def test_zero1_save_gathers_no_moments_and_resume_reads_one_dp_share():
    figures = run(2, str(TINY), ["model.vocab_size=512"], BLOCK_KIB)
    report("dp2", figures)
    for f in figures:
        held, total = f["held"], f["moments_total"]
        ends = 2 * 2 * (BLOCK_KIB << 10)  # 2 moments x a partial chunk at each end of the range (one dtype group)
        assert f["bitwise"], f
        assert f["read"] <= held["params"] + held["muon"] + total / 2 + ends, f
        assert f["gathered"] < total / 20, f  # fragments and the plan only: the old all-gather moved `total`


def test_row_blocks_tile_the_shard_and_read_back_exactly():
    """Rows of a tp shard map to global rectangles and back for every way a shard is cut; a block never crosses a
    tp region, so all ranks' blocks make one regular chunk grid."""
    import torch

    from pipeline.state_regions import block_rows, read_rows, row_regions
    from pipeline.tensor_parallel import ShardSpec, shard_tensor

    full = torch.arange(24 * 6, dtype=torch.float64).reshape(24, 6)
    for spec in (None, ShardSpec(0, 2), ShardSpec(0, 2, 3), ShardSpec(1, 2), ShardSpec(1, 3, 2)):
        for tp_rank in range(spec.tp if spec else 1):
            local = shard_tensor(full, spec, tp_rank) if spec else full
            k = block_rows(local.shape, spec, 8, target_bytes=2 * 6 * 8)
            region_rows = local.shape[0] // (spec.parts if spec is not None and spec.dim == 0 else 1)
            assert region_rows % k == 0 and 1 <= k * local[0].numel() * 8 <= 2 * 6 * 8
            for start, stop in ((0, local.shape[0]), (1, 3), (3, 7)):
                got = read_rows(lambda o, s: full[tuple(slice(a, a + n) for a, n in zip(o, s))], local.shape, spec,
                                tp_rank, start, stop)
                assert torch.equal(got, local[start:stop])
            for start in range(0, local.shape[0], k):
                shapes = {s for _, s, _ in row_regions(local.shape, spec, tp_rank, start, start + k)}
                offsets = [o for o, _, _ in row_regions(local.shape, spec, tp_rank, start, start + k)]
                assert len(shapes) == 1
                shape = shapes.pop()
                assert all(o % n == 0 for off in offsets for o, n in zip(off, shape))
