"""Depth-balanced data parallelism in the trainer: dp4 with sequences dealt by their FLOP cost (ranks holding
different numbers of rows and micro-batches) gives the single-process per-step losses in fp64 within 1e-12, and the
logged idle fractions are the ones computed independently from the sampler's depths and the dealing: idle_fraction
over FLOPs, idle_fraction_loop over core passes (the model's measured core passes equal the sum of each rank's
depths under the ragged loop)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from megaloop.config import load_config
from megaloop.depth import make_sampler
from megaloop.depth.balance import deal_by_depth, idle_fraction, row_costs
from megaloop.train.flops import FlopModel
from tests.pipeline.spawn import spawn
from tests.pipeline.workers_train import ReferenceRuntime, run, worker

TINY = Path(__file__).resolve().parents[2] / "configs" / "parcae-tiny.yaml"
STEPS, GLOBAL, DP = 4, 16, 4
TOL = 1e-12


def overrides(shards, out_dir, dp: int) -> list[str]:
    return [f"data.shards={shards}", f"train.out_dir={out_dir}", f"train.steps={STEPS}", "model.vocab_size=512",
            "model.d_model=64", "model.n_heads=2", "model.ve_gate_channels=16", "model.seq_len=32",
            "data.micro_batch_size=2", f"data.global_batch_size={GLOBAL}", "data.val_batches=0",
            "train.val_every=1000", "train.progress=false", "train.precision=fp64", f"parallel.dp={dp or 'null'}",
            "parallel.dp_balance=depth"]


def expected_idle(cfg) -> tuple[list[float], list[float]]:
    """(FLOP-weighted, loop-pass) idle_fraction per step from the depths of each global batch and the dealing."""
    m = cfg.model
    sampler = make_sampler(m.depth_sampler, m.mu_rec, m.backprop_depth, seed=cfg.train.seed)
    flops, loop = [], []
    for step in range(STEPS):
        sample = sampler.sample(step, np.arange(step * GLOBAL, (step + 1) * GLOBAL))
        depths = sample.T.numpy()
        costs = row_costs(sample.n.numpy(), sample.k.numpy(), *FlopModel.of(m).integer_coefficients())
        ranks = deal_by_depth(depths, DP, costs)
        flops.append(idle_fraction(int(costs.sum()), [int(costs[r].sum()) for r in ranks]))
        loop.append(idle_fraction(int(depths.sum()), [int(depths[r].sum()) for r in ranks]))
    return flops, loop


@pytest.mark.multiproc
def test_dp4_depth_balanced_equals_one_process(tiny_shards, tmp_path):
    ref = run(str(TINY), overrides(tiny_shards, tmp_path / "one", None), lambda c, d: ReferenceRuntime(d))
    runs = {"dp4": overrides(tiny_shards, tmp_path / "dp4", DP)}
    spawn(worker, DP, str(TINY), runs, str(tmp_path / "runs.pt"))
    got = torch.load(tmp_path / "runs.pt")["dp4"]
    records = [json.loads(line) for line in (tmp_path / "dp4" / "metrics.jsonl").read_text().splitlines()]
    logged_idle = [r["idle_fraction"] for r in records if r["kind"] == "train"]
    logged_loop = [r["idle_fraction_loop"] for r in records if r["kind"] == "train"]
    worst = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
    print(f"dp4 depth-balanced fp64: losses {got['losses']}, worst rel err vs one process {worst:.1e}; logged "
          f"idle_fraction {[round(v, 4) for v in logged_idle]}")
    assert len(got["losses"]) == len(ref["losses"]) == STEPS
    assert worst <= TOL
    cfg = load_config(TINY, overrides(tiny_shards, tmp_path / "dp4", DP))
    flops, loop = expected_idle(cfg)
    assert logged_idle == pytest.approx(flops, abs=1e-12) and logged_loop == pytest.approx(loop, abs=1e-12)
    single = [json.loads(line) for line in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["idle_fraction"] == r["idle_fraction_loop"] == 0.0 for r in single if r["kind"] == "train")
