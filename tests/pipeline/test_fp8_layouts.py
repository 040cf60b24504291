"""FP8 scales are layout-free: under tensor parallelism (with and without sequence parallelism) every scale of an
FP8 layer equals the single process's bit for bit on the same whole tensors, because the amax of each operand a
layer holds split is reduced over the tp group (pipeline/fp8.py): an MLP's column-parallel fc (plain and SwiGLU's
paired halves) and row-parallel proj, both recipes. Without the reduction (the control) the scales differ.

The trainer over tp2, dp2, pp2 and tp2 x dp2 against one process (10 steps, both recipes, fp32 and fp64) is
`python benchmarks/fp8_layouts.py`: there the weight scales stay bit-identical and the losses agree within 1e-4,
while an activation scale deeper in the model can move by a rounding, since each rank's FP8 GEMM sums its part of
the contraction (in fp32) before the all-reduce, in another order than one process."""
from __future__ import annotations

import pytest
import torch

from tests.pipeline.spawn import spawn
from tests.pipeline.workers_fp8 import tp_scales_worker

OUT_TOL = 1e-6  # fp32 output: the row-parallel partial sums are added in another order


@pytest.mark.multiproc
def test_tp2_scales_equal_single_process(tmp_path):
    out = tmp_path / "scales.pt"
    spawn(tp_scales_worker, 2, str(out))
    results = torch.load(out)
    assert len(results) == 2 * 2 * 3
    for (mlp, recipe, sp, reduce), got in results.items():
        print(f"{mlp} {recipe} sp={sp} amax reduced={reduce}: {len(got['equal'])} / {got['n']} scales "
              f"bit-identical, output rel err {got['y_err']:.1e}")
        assert got["n"] == 2 * 3  # fc and proj: x, w, g
        if reduce:
            assert len(got["equal"]) == got["n"] and got["y_err"] <= OUT_TOL
        else:  # rank-local amaxes: the split operands' scales are this rank's, not the tensor's
            assert len(got["equal"]) <= got["n"] - 2
