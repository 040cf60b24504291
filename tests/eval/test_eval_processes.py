"""Data parallelism over examples: two processes (torchrun, gloo) give exactly the numbers of one."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from megaloop.eval.depth_eval import Rows, row_losses
from megaloop.eval.scoring import Scorer
from tests.eval.eval_helpers import small_model
from tests.process_group import run_group

REPO = Path(__file__).resolve().parents[2]
SCRIPT = """
import json, sys, torch
from megaloop.eval.depth_eval import Rows, row_losses
from megaloop.eval.scoring import Scorer
from megaloop.eval.world import close_world, init_world
from tests.eval.test_eval_processes import inputs
from tests.eval.eval_helpers import small_model
world = init_world()
model = small_model(seed=3)
requests, rows = inputs()
scores = Scorer(model, 3, seed=1, batch_size=2, world=world).score(requests)
sums, counts = row_losses(model, rows, 2, seed=1, batch_size=2, world=world)
close_world(world)
if world.rank == 0:
    print(json.dumps({"size": world.size, "scores": [[s.logprob, s.greedy] for s in scores], "sums": sums.tolist()}))
"""


def inputs():
    g = torch.Generator().manual_seed(9)
    requests = [(torch.randint(3, 260, (int(n),), generator=g).tolist(), torch.randint(3, 260, (3,), generator=g)
                 .tolist()) for n in torch.randint(1, 20, (9,), generator=g)]
    tokens = torch.randint(3, 260, (7, 25), generator=g)
    return requests, Rows(tokens, torch.ones(7, 24, dtype=torch.bool), torch.arange(7))


@pytest.mark.multiproc
def test_two_processes_equal_one(tmp_path):
    script = tmp_path / "score.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = run_group([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                      str(script)], timeout=240, capture_output=True, text=True, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    model = small_model(seed=3)
    requests, rows = inputs()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the two processes: bit for bit needs equal thread counts (summation order)
    try:
        one = Scorer(model, 3, seed=1, batch_size=2).score(requests)
        sums, _ = row_losses(model, rows, 2, seed=1, batch_size=2)
    finally:
        torch.set_num_threads(threads)
    assert got["size"] == 2
    assert got["scores"] == [[s.logprob, s.greedy] for s in one]  # bit for bit
    assert got["sums"] == sums.tolist()
