"""Failures a batch script trusts the outcome of: gloo with a CUDA device is refused when the config is loaded, a
flash-attn that is installed but broken is an error naming the package (resolved once, when the model is built),
and periodic checkpoint saves failing in a row end the run (a failed final save: test_checkpoint_resume.py)."""
from __future__ import annotations

import sys

import pytest
import torch

from megaloop.config import ConfigError, load_config


@pytest.mark.parametrize("device", ["cuda", "auto"])
def test_gloo_with_a_cuda_device_is_refused_at_config_load(device, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # "auto" picks the GPU on a machine with one
    with pytest.raises(ConfigError) as err:
        load_config(None, ["parallel.backend=gloo", f"train.device={device}"])
    message = str(err.value)
    assert "\n" not in message and message.startswith("config error: parallel.backend='gloo': with a CUDA device")
    assert "use parallel.backend=auto" in message and "train.device=cpu" in message
    load_config(None, ["parallel.backend=gloo", "train.device=cpu"])  # gloo on the CPU is what the tests run
    load_config(None, ["parallel.backend=auto", f"train.device={device}"])


@pytest.fixture
def flash_modules(tmp_path, monkeypatch):
    """A directory on sys.path to put fake flash-attn packages in; the per-process lookup is forgotten around the
    test, and the real packages (if any) hidden."""
    from megaloop.model import attention

    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)  # FA3 absent: its import raises ModuleNotFoundError
    attention.flash_function.cache_clear()
    yield tmp_path
    attention.flash_function.cache_clear()


def test_a_broken_flash_attn_is_an_error_naming_the_package(flash_modules, monkeypatch):
    from megaloop.model.attention import AttentionBackendError, resolve_attention_backend
    from megaloop.train.cli import check_before_training

    package = flash_modules / "flash_attn"
    package.mkdir()  # installed, but its compiled extension does not load (built for another torch)
    (package / "__init__.py").write_text('raise ImportError("flash_attn_2_cuda.so: undefined symbol: '
                                         '_ZN3c104cuda9SetDeviceEi")\n')
    with pytest.raises(AttentionBackendError) as err:
        resolve_attention_backend("auto", "cuda")
    message = str(err.value)
    assert message.startswith("flash-attn 2 (flash_attn) is installed but cannot be imported (ImportError: "
                              "flash_attn_2_cuda.so: undefined symbol")
    assert "reinstall it" in message and "model.attention=sdpa" in message
    assert resolve_attention_backend("auto", "cpu") == "sdpa"  # the CPU never looks for flash-attn
    (package / "__init__.py").write_text("import einops_not_here\n")  # a dependency missing: still broken
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ConfigError, match="model.attention='auto': flash-attn 2 .flash_attn. is installed but "
                       "cannot be imported .ModuleNotFoundError: No module named 'einops_not_here'"):
        check_before_training(load_config(None, ["train.device=auto"]))  # before anything is built: exit code 2


def test_an_absent_flash_attn_is_sdpa_and_the_backend_is_set_once_at_build(flash_modules, monkeypatch):
    from megaloop.model.attention import Attention, AttentionBackendError, resolve_attention_backend
    from megaloop.train.loop import build_model_and_optimizer
    from megaloop.train.runtime import SingleProcessRuntime

    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not installed: import raises ModuleNotFoundError
    assert resolve_attention_backend("auto", "cuda") == "sdpa"
    with pytest.raises(AttentionBackendError, match="model.attention=flash2 but flash-attn 2 .flash_attn. is not "
                       "installed"):
        resolve_attention_backend("flash2", "cuda")
    cfg = load_config(None, ["model.d_model=64", "model.n_heads=2", "model.n_core=1", "model.vocab_size=256",
                             "model.ve_gate_channels=16", "train.precision=fp32"])
    model, _ = build_model_and_optimizer(cfg, SingleProcessRuntime(torch.device("cpu")), torch.device("cpu"), False)
    backends = {m.backend for m in model.modules() if isinstance(m, Attention)}
    assert backends == {"sdpa"}  # resolved from "auto" once, for the device: no lookup per call


class _FakeSaver:
    def __init__(self, results):
        self.results = results

    def wait(self, all_written=None):
        return None

    def take_results(self):
        out, self.results = self.results, []
        return out


def test_periodic_saves_failing_in_a_row_end_the_run_and_each_failure_is_recorded():
    from pathlib import Path

    from checkpoints.save import SaveResult
    from megaloop.train.checkpointing import MAX_FAILED_SAVES, RunCheckpoints, SaveFailed
    from megaloop.train.runtime import SingleProcessRuntime

    ckpt = RunCheckpoints(load_config(None, []), SingleProcessRuntime(torch.device("cpu")))
    records = []
    ckpt.record = records.append

    def finish(step, ok):
        ckpt._checkpointer = _FakeSaver([SaveResult(step, Path("x"), ok, None if ok else "disk full")])
        ckpt.wait()

    finish(10, False)  # one failure: recorded, training goes on
    finish(20, True)   # a success resets the count
    finish(30, False)
    assert [(r["step"], r["in_a_row"], r["fatal"]) for r in records] == [(10, 1, False), (30, 1, False)]
    assert MAX_FAILED_SAVES == 2
    with pytest.raises(SaveFailed, match=r"2 checkpoints in a row \(step 40\) FAILED"):
        finish(40, False)
    assert records[-1] == {"kind": "checkpoint_failed", "step": 40, "error": "disk full", "in_a_row": 2,
                           "fatal": True}
    ckpt._checkpointer = _FakeSaver([SaveResult(50, Path("x"), False, "disk full")])
    ckpt.wait(agree=False)  # closing: reported, never raised
    ckpt._checkpointer = None
