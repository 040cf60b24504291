"""The attention kernel that runs: under bf16 autocast q, k and v reach the kernel in bf16 whatever promoted them
(RoPE's fp32 tables, CUDA autocast's fp32 rms_norm, reproduced here, the fp32 value embeddings), every call is
counted; a kernel named in model.attention that cannot take a call fails at that first call with the reason, and
auto's kernel falls back to sdpa for such a call, said once per reason and counted.

The flash kernel is a stand-in that records its inputs and computes what flash-attn computes; the device rule
("CUDA tensors") is relaxed to let it run on the CPU, the dtype rule kept."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megaloop.config import load_config
from megaloop.model import attention, build_model
from megaloop.model.attention import AttentionBackendError, set_attention_backend
from tests.model.test_attention_backends import reference_flash

TINY = "configs/parcae-tiny.yaml"


@pytest.fixture
def stand_in(monkeypatch):
    """flash2 as a recording stand-in, allowed on the CPU; rms_norm returning fp32 as CUDA autocast makes it."""
    seen = []

    def flash(q, k, v, causal=True, softmax_scale=None):
        seen.append((q.dtype, k.dtype, v.dtype))
        return reference_flash(q.float(), k.float(), v.float(), causal, softmax_scale).to(q.dtype)

    def cpu_rule(backend, q, k, v):
        same_half = len({q.dtype, k.dtype, v.dtype}) == 1 and q.dtype in (torch.bfloat16, torch.float16)
        return None if same_half else f"{backend} takes bf16 or fp16 tensors of one dtype, this call has " \
            f"q/k/v {q.dtype}/{k.dtype}/{v.dtype}"

    monkeypatch.setattr(attention, "flash_function", lambda backend: flash)
    monkeypatch.setattr(attention, "_cannot_take", cpu_rule)
    monkeypatch.setattr(attention, "rms_norm_weightless", lambda x: F.rms_norm(x.float(), (x.size(-1),)))
    attention.reset_kernel_calls()
    attention._NOTED.clear()
    yield seen
    attention.reset_kernel_calls()
    attention._NOTED.clear()


def _model_and_batch():
    cfg = load_config(TINY, ["model.vocab_size=256", "model.seq_len=32"], validate=False).model
    model = build_model(cfg, device="cpu", seed=0)
    ids = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    return model, ids[:, :-1], ids[:, 1:]


def test_bf16_qkv_reach_the_configured_kernel_and_every_call_is_counted(stand_in):
    model, ids, labels = _model_and_batch()
    set_attention_backend(model, "flash2", configured=True)
    with torch.autocast("cpu", torch.bfloat16):
        loss = model(ids, labels=labels, depth=3, backprop_depth=2).loss
    loss.backward()
    assert stand_in and set(stand_in) == {(torch.bfloat16,) * 3}, stand_in
    calls, fallbacks = attention.kernel_calls()
    cfg = model.cfg  # prelude and coda once, the core's blocks once per lap (3)
    assert calls == {"flash2": cfg.n_prelude + cfg.n_coda + 3 * cfg.n_core} == {"flash2": len(stand_in)}
    assert not fallbacks


def test_a_configured_kernel_that_cannot_take_a_call_fails_at_the_first_call(stand_in):
    model, ids, labels = _model_and_batch()
    set_attention_backend(model, "flash2", configured=True)
    with pytest.raises(AttentionBackendError, match=r"model.attention=flash2 cannot run this call: .*"
                                                    r"q/k/v torch.float32/torch.float32/torch.float32"):
        model(ids, labels=labels, depth=2, backprop_depth=1)  # fp32: no autocast
    assert not stand_in and attention.kernel_calls() == ({}, {})


def test_auto_falls_back_to_sdpa_said_once_and_counted(stand_in, capsys):
    model, ids, labels = _model_and_batch()
    set_attention_backend(model, "flash2", configured=False)  # what auto resolves to on a GPU with flash-attn
    with torch.no_grad():
        for _ in range(2):
            model(ids, labels=labels, depth=2, backprop_depth=1)
    calls, fallbacks = attention.kernel_calls()
    assert list(calls) == ["sdpa"] and sum(fallbacks.values()) == calls["sdpa"] and len(fallbacks) == 1
    notes = [line for line in capsys.readouterr().err.splitlines() if "falls back to sdpa" in line]
    assert len(notes) == 1 and "float32" in notes[0], notes
    assert not stand_in
