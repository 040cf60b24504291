"""Per-parameter initialisation: each parameter is a pure function of (seed, name), with the same bits on 1 and 2
threads, whatever subset is initialised and in which order; the reference's statistics still hold; a meta build
materialising some names allocates only those."""
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megaloop.model import build_model, init_parameter, materialize
from megaloop.model.injection import dt_bias_init
from tests.model.helpers import small_config

ROOT = Path(__file__).resolve().parents[2]
ORTHOGONAL = ("embed.weight", "C.weight", ".attn.q.weight", ".attn.k.weight", ".attn.v.weight", ".mlp.fc.weight")
ZERO = (".attn.proj.weight", ".mlp.proj.weight", "injection.A_log")

_INIT_ON_THREADS = """
import sys, torch
torch.set_num_threads(int(sys.argv[1]))
from megaloop.model import build_model, materialize
from tests.model.helpers import small_config
assert torch.get_num_threads() == int(sys.argv[1])
model = materialize(build_model(small_config(d_model=128, vocab_size=512), device="meta"), seed=7, dtype=torch.float64)
state = {k: v.clone() for k, v in model.state_dict().items()}
assert torch.get_num_threads() == int(sys.argv[1]), "the init must restore the caller's thread count"
torch.save(state, sys.argv[2])
"""


def test_same_bits_on_one_and_two_threads(tmp_path):
    """Two fresh processes, one on 1 thread and one on 2: every parameter is bit-identical in float64 (LAPACK's QR on
    2 threads differs from 1 thread by ~1e-16 in float64 at these sizes, ~1e-7 in float32)."""
    states = []
    for threads in (1, 2):
        out = tmp_path / f"init_{threads}.pt"
        subprocess.run([sys.executable, "-c", _INIT_ON_THREADS, str(threads), str(out)], cwd=ROOT, check=True)
        states.append(torch.load(out))
    one, two = states
    assert one.keys() == two.keys()
    differing = [k for k in one if not torch.equal(one[k], two[k])]
    assert not differing, f"parameters differ between 1 and 2 threads: {differing}"


@pytest.mark.parametrize("injection", ["diagonal", "concat"])
def test_any_subset_in_any_order_equals_the_whole_model_init(injection):
    cfg = small_config(injection=injection, arch="parcae" if injection == "diagonal" else "rdm")
    whole = dict(build_model(cfg, seed=3).named_parameters())
    names = list(whole)
    subset = names[::3][::-1]  # every third name, initialised in reverse order
    model = materialize(build_model(cfg, device="meta"), names=subset, seed=3)
    for name, p in model.named_parameters():
        if name in subset:
            assert torch.equal(p, whole[name]), name
        else:
            assert p.is_meta, name
    one = init_parameter(cfg, names[-2], whole[names[-2]].shape, seed=3)
    assert torch.equal(one, whole[names[-2]])
    other_seed = init_parameter(cfg, "core.0.attn.q.weight", whole["core.0.attn.q.weight"].shape, seed=4)
    assert not torch.equal(other_seed, whole["core.0.attn.q.weight"])


def test_build_model_equals_materialize_on_meta_and_reset_parameters():
    cfg = small_config()
    built = build_model(cfg, seed=5)
    meta = materialize(build_model(cfg, device="meta"), seed=5)
    reset = build_model(cfg, seed=0)
    reset.reset_parameters(5)
    for (name, a), b, c in zip(built.state_dict().items(), meta.state_dict().values(), reset.state_dict().values()):
        assert torch.equal(a, b) and torch.equal(a, c), name
        assert a.is_contiguous() and b.is_contiguous(), f"{name}: optimizers and flat buffers expect row-major"


def test_reference_statistics_in_fp64():
    """W W^T = gain^2 I (the shorter side orthonormal) within 1e-10, gain = sigma sqrt(max(rows, cols)); zeros, ones,
    the injection's A_log = 0, dt_bias = softplus^-1(0.5 ln 5), B = I; value embeddings ~ N(0, 1)."""
    cfg = small_config(d_model=64, vocab_size=512, n_kv_heads=2)  # k, v: 32 x 64, wider than tall
    model = materialize(build_model(cfg, device="meta"), seed=11, dtype=torch.float64)
    assert model.core[0].attn.k.weight.shape == (32, 64)
    sigma = math.sqrt(2.0 / (5.0 * cfg.d_model))
    checked = 0
    for name, p in model.named_parameters():
        assert p.dtype == torch.float64
        if name.endswith(ORTHOGONAL):
            rows, cols = p.shape
            w = p if rows <= cols else p.t()
            gain = sigma * math.sqrt(max(rows, cols))
            assert torch.allclose(w @ w.t(), gain ** 2 * torch.eye(min(rows, cols), dtype=torch.float64),
                                  rtol=0, atol=1e-10), name
            assert abs(p.std().item() / sigma - 1) < 0.05, name
            checked += 1
        elif name.endswith(ZERO):
            assert not p.any(), name
        elif "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
    assert checked == 1 + 1 + 4 * cfg.n_layers
    inj = model.injection
    assert torch.equal(inj.dt_bias, torch.full_like(inj.dt_bias, dt_bias_init()))
    assert abs(torch.nn.functional.softplus(inj.dt_bias[0]).item() - 0.5 * math.log(5)) < 1e-12
    assert torch.equal(inj.B, torch.eye(cfg.d_model, dtype=torch.float64))
    ve = torch.cat([t.weight.flatten() for t in model.value_embeds.values()])
    assert abs(ve.mean().item()) < 0.02 and abs(ve.std().item() - 1) < 0.02


def test_concat_injection_and_ve_gate_ranges():
    cfg = small_config(arch="rdm", injection="concat")
    model = build_model(cfg, seed=2)
    w, std = model.injection.W.weight, cfg.std
    assert w.abs().max() <= 3 * std and abs(w.std().item() / std - 1) < 0.2
    gate = model.core[0].attn.ve_gate.weight
    bound = 1 / math.sqrt(gate.shape[1])
    assert gate.abs().max() <= bound and gate.std() > bound / 4


def test_meta_build_materialises_only_the_named_parameters():
    cfg = small_config(d_model=128, vocab_size=1024)
    names = ["core.1.attn.q.weight", "core.1.mlp.fc.weight", "final_norm.weight"]
    model = materialize(build_model(cfg, device="meta"), names=names, seed=0)
    real = {n: p for n, p in model.named_parameters() if not p.is_meta}
    assert sorted(real) == sorted(names)
    expected = 4 * (128 * 128 + 4 * 128 * 128 + 128)
    assert sum(p.numel() * p.element_size() for p in real.values()) == expected
    assert not model.rope_cos.is_meta and model.rope_cos.shape == (cfg.seq_len, cfg.head_dim // 2)


def test_unknown_names_are_refused_with_the_valid_form():
    cfg = small_config()
    with pytest.raises(ValueError, match="not parameters of this model"):
        materialize(build_model(cfg, device="meta"), names=["core.9.attn.q.weight"])
    with pytest.raises(ValueError, match="no initialisation rule"):
        init_parameter(cfg, "core.0.attn.bias", (4,))
