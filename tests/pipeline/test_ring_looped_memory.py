"""Laps without backward store nothing when LoopedLM runs as ring-pipeline stages: parcae-tiny (4 core blocks,
the shapes of workers_ring) at pp 2 and 4, three micro-batches whose deepest rows run n + 2 laps (n = 4, 16, 64
without gradient, the last 2 with it; other rows join the ragged loop late), scheduled by ring_schedule and run by
RingExecutor, which counts the bytes autograd saves (pipeline.ring.saved).

Per rank, the peak autograd-saved bytes at n = 16 and 64 must stay within 10% of those at n = 4. The same runs with
gradient through every lap (backprop depth = depth) show that the measurement sees stored laps: their peak must
grow with n, and so must its ratio to the truncated run's."""
from __future__ import annotations

import pytest
import torch

from tests.pipeline.spawn import spawn
from tests.pipeline.workers_ring import NO_GRAD_LAPS, memory_worker

SLACK = 1.1


@pytest.mark.multiproc
@pytest.mark.parametrize("pp", [2, 4])
def test_no_grad_laps_store_nothing(pp, tmp_path):
    out = str(tmp_path / "mem")
    spawn(memory_worker, pp, out)
    for rank in range(pp):
        peaks = torch.load(f"{out}.{rank}")
        truncated = [peaks[False, n][1] for n in NO_GRAD_LAPS]
        full = [peaks[True, n][1] for n in NO_GRAD_LAPS]
        ratios = [f / t for f, t in zip(full, truncated)]
        print(f"pp={pp} rank {rank}: no-grad laps n -> peak autograd-saved bytes with 2 grad laps "
              f"{dict(zip(NO_GRAD_LAPS, truncated))} (x{truncated[-1] / truncated[0]:.3f} from n=4 to n=64; peak "
              f"stored groups {[peaks[False, n][0] for n in NO_GRAD_LAPS]}), with all n + 2 laps "
              f"{dict(zip(NO_GRAD_LAPS, full))}, all / 2 grad laps {[round(r, 2) for r in ratios]}")
        assert truncated[0] > 0, f"rank {rank} saved nothing for its 2 laps with gradient"
        assert all(t <= SLACK * truncated[0] for t in truncated[1:]), \
            f"rank {rank}: autograd-saved bytes grow with the laps without gradient: {truncated}"
        assert full[0] < full[1] < full[2] and ratios[0] < ratios[1] < ratios[2], \
            f"rank {rank}: saved bytes with gradient through every lap do not grow with n: {full}"
