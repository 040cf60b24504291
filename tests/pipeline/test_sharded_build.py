"""Under tensor parallelism the trainer builds the model on the meta device and each rank materialises only the
parameters it holds (megaloop/train/build.py): every held parameter must equal, bit for bit, the single-process
eager build cut by the same shard spec (fp32, and fp64 where an eager build rounds through fp32 first), the RoPE
tables must be those of an eager build, and a rank must hold about 1/tp of the split parameters' bytes."""
from __future__ import annotations

import pytest
import torch

from tests.pipeline.spawn import spawn
from tests.pipeline.test_layout_equivalence import TINY, overrides
from tests.pipeline.workers_train import sharded_build_worker


@pytest.mark.multiproc
@pytest.mark.parametrize("precision", ["fp32", "fp64"])
def test_tp2_ranks_materialise_their_shards_of_the_eager_build(tiny_shards, tmp_path, precision):
    sets = overrides(tiny_shards, tmp_path / "run", "parcae", precision, tp=2)
    spawn(sharded_build_worker, 2, str(TINY), sets, str(tmp_path / "build"))
    results = [torch.load(f"{tmp_path / 'build'}.{rank}") for rank in range(2)]
    for rank, r in enumerate(results):
        print(f"tp2 {precision} rank {rank}: {r['equal']}/{r['params']} parameters bit-identical to the eager "
              f"build's shard ({r['split']} split), RoPE equal {r['rope']}, holds {r['held_bytes']:,} of "
              f"{r['full_bytes']:,} bytes ({r['held_bytes'] / r['full_bytes']:.3f}), {r['dtype']}")
        assert r["equal"] == r["params"] and r["rope"], r
        assert r["split"] > 0 and r["held_bytes"] < 0.75 * r["full_bytes"], r
