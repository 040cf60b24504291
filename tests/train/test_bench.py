"""`megaloop bench`: the figures of the measured steps (checked against the run's own records by hand), the peak
table's lookup by full device name, and one short end-to-end run with its table and PNG."""
from __future__ import annotations

import json
import math

import pytest

from megaloop.config import load_config
from megaloop.train.bench import SPLIT, format_table, summarise
from megaloop.train.flops import FlopModel
from megaloop.train.peak import gpu_peak
from tests.train.conftest import TINY, fast_overrides


def _record(step, **kw):
    base = {"kind": "train", "step": step, "tokens": 1000, "useful_flops": 4e9, "executed_flops": 5e9,
            "executed_depth": 6.0, "time_step": 2.0, "time_data": 0.1, "time_forward": 0.6, "time_backward": 0.9,
            "time_communication": 0.1, "time_optimizer": 0.2, "time_pipeline_idle": 0.0}
    return {**base, **kw}


def test_summarise_by_hand():
    cfg = load_config(TINY, ["train.activation_checkpointing=lap"], validate=False)  # mu_rec 4, mu_bwd 2
    records = [_record(2), _record(3, time_step=4.0, time_forward=float("nan"), useful_flops=8e9)]
    f = summarise(records, cfg, 2, "fp32", {"bf16 dense": 1.0, "fp32 (the run's precision)": 0.5},
                  {"bf16 dense": "x", "fp32 (the run's precision)": "y"})
    assert f.tokens_per_s == pytest.approx(2000 / 6.0)
    assert f.useful_tflops == pytest.approx(12e9 / 6.0 / 1e12)
    assert f.executed_tflops == pytest.approx(10e9 / 6.0 / 1e12)
    k = 2  # min(backprop depth 2, executed depth 6): one more forward of each gradient lap
    recompute = 2000 * k * FlopModel.of(cfg.model).step_grad / 3
    assert f.hardware_tflops == pytest.approx((10e9 + recompute) / 6.0 / 1e12)
    assert f.mfu["fp32 (the run's precision)"] == pytest.approx(f.useful_tflops / 0.5)  # fp32: a number
    assert f.split_s["forward"] == pytest.approx(0.3)  # a NaN time (a GPU's first step) counts as 0
    assert f.split_s["other"] == pytest.approx(3.0 - (0.1 + 0.3 + 0.9 + 0.1 + 0.2))
    assert sum(f.split_s[s] for s in SPLIT) == pytest.approx(f.step_s)


def test_gpu_phase_times_are_paired_with_their_own_step():
    """On a GPU record s holds step s-1's phase times (time_phases_step): each measured step's forward ... is read
    from the next record and set beside that step's own wall time, so a slow warm-up step's phases (reported by the
    first measured record) never enter the split, and a bench's trailing record supplies the last step's."""
    cfg = load_config(TINY, [], validate=False)
    slow_warmup = _record(1, time_phases_step=0, time_forward=9.0, time_backward=9.0)  # step 0's phases
    measured = [slow_warmup] + [_record(s, time_phases_step=s - 1, time_step=1.0 + s, time_data=0.01 * s,
                                        time_forward=0.1 * (s - 1), time_backward=0.2) for s in (2, 3)]
    trailing = _record(4, time_phases_step=3, time_forward=0.3, time_backward=0.2)
    f = summarise(measured, cfg, 1, "bf16", {"bf16 dense": 1.0}, {"bf16 dense": "x"}, later=[trailing])
    # steps 1, 2, 3 have phases (from records 2, 3, 4): forward 0.1, 0.2, 0.3; wall 2.0, 3.0, 4.0; data 0.1, 0.02, 0.03
    assert f.split_steps == 3
    assert f.split_s["forward"] == pytest.approx(0.2)
    assert f.split_s["backward"] == pytest.approx(0.2)
    assert f.split_s["data"] == pytest.approx((0.1 + 0.02 + 0.03) / 3)
    assert f.step_s == pytest.approx(3.0)
    assert sum(f.split_s[s] for s in SPLIT) == pytest.approx(f.step_s)
    without_trailing = summarise(measured, cfg, 1, "bf16", {"bf16 dense": 1.0}, {"bf16 dense": "x"})
    assert without_trailing.split_steps == 2 and without_trailing.split_s["forward"] == pytest.approx(0.15)
    assert "2 of the 3 measured steps" in format_table(without_trailing, "t")


@pytest.mark.parametrize("name,prec,want", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4), ("NVIDIA H100 PCIe", "bf16", 756.5), ("NVIDIA H100 NVL", "fp8", 1670.5),
    ("NVIDIA H200", "fp8", 1978.9), ("NVIDIA H200 NVL", "bf16", 835.5), ("NVIDIA A100-SXM4-80GB", "fp32", 19.5),
    ("NVIDIA H100 80GB HBM3", "fp32", 66.9), ("NVIDIA GH200 480GB", "bf16", math.nan),
    ("NVIDIA A100 80GB PCIe", "fp8", math.nan)])
def test_gpu_peak_by_full_device_name(name, prec, want):
    got = gpu_peak(name, prec).tflops
    assert (math.isnan(got) and math.isnan(want)) or got == want


def test_bench_end_to_end(tiny_shards, tmp_path, capsys):
    from megaloop.__main__ import main

    out = tmp_path / "run"
    sets = [s for s in fast_overrides(tiny_shards, out, 1) if not s.startswith(("train.steps", "train.out_dir"))]
    argv = ["bench", str(TINY), "--steps", "2", "--warmup", "1", "--out-dir", str(out), "--json"]
    assert main(argv + [a for s in sets for a in ("--set", s)]) == 0
    printed = capsys.readouterr().out
    figures = json.loads(printed.strip().splitlines()[-1])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    measured = [r for r in records if r["kind"] == "train" and r["step"] >= 1]
    assert figures["steps"] == len(measured) == 2
    wall = sum(r["time_step"] for r in measured)
    assert figures["tokens_per_s"] == pytest.approx(sum(r["tokens"] for r in measured) / wall)
    assert figures["useful_tflops"] == pytest.approx(sum(r["useful_flops"] for r in measured) / wall / 1e12)
    assert set(figures["mfu"]) == {"bf16 dense", "FP8 dense", "fp32 (the run's precision)"}
    # CPU: every peak measured here, so a number for fp32 too; MFU is the useful rate over each peak. Only the run's
    # own precision bounds it by 1: a CPU without native bf16 (or under load when its bf16 peak was measured) runs
    # an fp32 step faster than its bf16 "peak"
    for label, mfu in figures["mfu"].items():
        assert mfu == pytest.approx(figures["useful_tflops"] / figures["peaks"][label]) and mfu > 0, (label, figures)
    assert 0 < figures["mfu"]["fp32 (the run's precision)"] < 1, figures
    assert "MFU vs bf16 dense peak" in printed and "pipeline idle" in printed
    assert (out / "bench.png").stat().st_size > 1000
    assert main(argv + [a for s in sets for a in ("--set", s)]) == 2  # the directory holds a run already
    assert "--out-dir" in capsys.readouterr().err
