"""The Transformer Engine backend's CPU-side parts (pipeline/te_backend.py): on a machine without CUDA it fails in
one line and never imports transformer_engine; DelayedScaling is refused for a module the loop calls T times; the
state_dict key mapping between TE and native models, both ways. The TE modules themselves (CUDA only) are checked by
scripts/gpu_check.sh (tests/gpu/test_gpu_fp8.py)."""
from __future__ import annotations

import importlib.abc
import sys

import pytest
import torch

from megaloop.config import load_config
from megaloop.model import build_model
from megaloop.train.fp8 import CORE, OUTER, with_fp8
from pipeline.te_backend import (EXTRA_STATE, TransformerEngineUnavailable, native_to_te, require_te, te_recipe,
                                 te_state_keys, te_to_native)
from tests.model.helpers import small_config
from tests.train.conftest import TINY


class ImportRecorder(importlib.abc.MetaPathFinder):
    """Records every attempt to import transformer_engine (and lets it fail)."""

    def __init__(self):
        self.attempts = []

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "transformer_engine":
            self.attempts.append(name)
            raise ImportError(f"{name} is blocked by the test")
        return None


@pytest.fixture
def recorder(monkeypatch):
    rec = ImportRecorder()
    monkeypatch.setattr(sys, "meta_path", [rec, *sys.meta_path])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    return rec


def test_te_backend_on_cpu_fails_in_one_line_without_importing_te(recorder):
    cfg = load_config(str(TINY), ["train.fp8=tensorwise", "train.fp8_backend=te"])
    with pytest.raises(TransformerEngineUnavailable) as err:
        with_fp8(lambda model, info: None, cfg.train, runtime=None)
    message = str(err.value)
    assert "\n" not in message and "needs a CUDA GPU" in message and "train.fp8_backend=torchao" in message
    with pytest.raises(TransformerEngineUnavailable):
        require_te()
    assert recorder.attempts == [] and not any(m.startswith("transformer_engine") for m in sys.modules)


def test_te_import_failure_is_one_line(recorder, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU machine whose TE is broken or absent
    with pytest.raises(TransformerEngineUnavailable) as err:
        require_te()
    assert "\n" not in str(err.value) and "cannot be imported" in str(err.value)
    assert recorder.attempts == ["transformer_engine"]


def test_delayed_scaling_refused_for_modules_called_more_than_once(recorder):
    with pytest.raises(ValueError, match="runs 4 times per step"):
        te_recipe("delayed", calls_per_step=4)
    with pytest.raises(ValueError, match="use 'current'"):
        te_recipe("mxfp8", calls_per_step=1)
    assert recorder.attempts == []  # refused before TE is imported


def test_rowwise_with_te_is_a_config_error():
    with pytest.raises(ValueError, match="train.fp8=.*Float8CurrentScaling"):
        load_config(str(TINY), ["train.fp8=rowwise", "train.fp8_backend=te"])


def test_key_mapping_both_ways():
    cfg = small_config(d_model=64, vocab_size=256, ve_gate_channels=8)
    model = build_model(cfg, device="meta")  # names and shapes only
    native = model.state_dict()
    keys = te_state_keys(model, CORE + OUTER)
    extras = [k for k in keys if k.endswith(EXTRA_STATE)]
    linears = [f"{b}.{layer}" for b in ("prelude.0", "core.0", "core.1", "coda.0")
               for layer in ("attn.q", "attn.k", "attn.v", "attn.proj", "mlp.fc", "mlp.proj")]
    assert extras == [f"{name}.{EXTRA_STATE}" for name in linears]  # not ve_gate (8 -> 4): it stays native
    assert [k for k in keys if not k.endswith(EXTRA_STATE)] == list(native)
    assert all(keys[keys.index(e) - 1] == e.replace(EXTRA_STATE, "weight") for e in extras)
    meta = {extras[0]: torch.tensor([1, 2, 3], dtype=torch.uint8)}
    te_state = native_to_te(native, keys, meta)
    assert list(te_state) == keys and torch.equal(te_state[extras[0]], meta[extras[0]])
    assert te_state[extras[1]].numel() == 0  # TE's "no FP8 metadata yet"
    back = te_to_native(te_state)
    assert list(back) == list(native) and all(back[k] is native[k] for k in native)
    with pytest.raises(KeyError, match="missing"):
        native_to_te({k: v for k, v in native.items() if k != "core.0.attn.q.weight"}, keys)
