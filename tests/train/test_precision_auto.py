"""train.precision=auto: bf16 only where the device computes it natively, fp32 otherwise, and the run says which and
why. A CPU without native bf16 is had on any machine by capping oneDNN (ONEDNN_MAX_CPU_ISA=AVX2), which is what
makes torch's bf16 matmuls slow on an AVX2-only CPU; the capability probes are patched for the opposite case."""
from __future__ import annotations

import json

import pytest
import torch

from megaloop.config import load_config
from megaloop.train import hardware
from megaloop.train.cli import run_training
from megaloop.train.precision import autocast_for, orth_dtype, param_dtype, resolve_precision
from tests.train.conftest import TINY, fast_overrides

CPU = torch.device("cpu")


@pytest.fixture
def no_native_bf16(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")


@pytest.fixture
def native_bf16(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)


def test_auto_is_fp32_without_native_bf16(no_native_bf16):
    choice = resolve_precision("auto", CPU)
    assert (choice.precision, choice.requested, choice.native_bf16) == ("fp32", "auto", False)
    assert "no native bf16" in choice.why and "ONEDNN_MAX_CPU_ISA=AVX2" in choice.why
    assert "Polar Express in fp32" in choice.header() and choice.warning is None


def test_auto_is_bf16_with_native_bf16(native_bf16):
    choice = resolve_precision("auto", CPU)
    assert (choice.precision, choice.native_bf16) == ("bf16", True)
    assert "natively" in choice.why and "Polar Express in bf16" in choice.header()


def test_a_cpu_without_the_units_has_no_native_bf16(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    support = hardware.cpu_bf16_support()
    assert not support.native and "no AVX512-BF16 or AMX" in support.why


def test_a_cap_at_or_above_native_bf16_keeps_it(native_bf16, monkeypatch):
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "avx512_core_amx")
    assert hardware.cpu_bf16_support().native


def test_explicit_bf16_without_native_bf16_runs_with_a_warning(no_native_bf16):
    choice = resolve_precision("bf16", CPU, slowdown=lambda: 37.4)
    assert choice.precision == "bf16" and choice.native_bf16 is False
    assert "measured 37x slower than fp32" in choice.warning and "train.precision=auto" in choice.warning
    assert "\n" not in choice.warning


def test_explicit_precisions_are_kept(no_native_bf16):
    assert [resolve_precision(p, CPU).precision for p in ("fp32", "fp64")] == ["fp32", "fp64"]


def test_polar_express_follows_the_hardware():
    assert orth_dtype("fp32", native_bf16=True) == torch.bfloat16  # the reference
    assert orth_dtype("bf16", native_bf16=False) == torch.float32
    assert orth_dtype("fp64", native_bf16=False) == torch.float64


def test_unresolved_auto_is_refused_where_a_dtype_is_needed():
    for use in (param_dtype, orth_dtype, lambda precision: autocast_for(precision, CPU)):
        with pytest.raises(ValueError, match="resolve train.precision=auto"):
            use("auto")


def test_auto_run_without_native_bf16_trains_in_fp32_and_says_why(tiny_shards, tmp_path, no_native_bf16, capsys):
    overrides = [o for o in fast_overrides(tiny_shards, tmp_path, steps=2) if not o.startswith("train.precision")]
    cfg = load_config(TINY, overrides + ["train.precision=auto"])
    assert run_training(cfg) == 0
    header = capsys.readouterr().err.splitlines()[0]
    print(header)
    assert "precision fp32 (auto: this CPU" in header and "ONEDNN_MAX_CPU_ISA=AVX2" in header
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["precision"] == "fp32" and summary["precision_why"].startswith("auto: ")
    assert json.loads((tmp_path / "config.json").read_text())["train"]["precision"] == "fp32"
