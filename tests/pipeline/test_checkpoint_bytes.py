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
