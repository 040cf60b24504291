"""FLOP accounting: the reference's convention reproduces its published GFLOP/token table, our convention is
checked against a hand count, and useful vs executed FLOPs follow the depths of a micro-batch."""
from pathlib import Path

import pytest
import torch

from megaloop.config import ModelConfig, load_config
from megaloop.model import build_model, count_parameters
from megaloop.train.flops import FlopModel, reference_flops_per_token

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PUBLISHED_GFLOP_PER_TOKEN = {
    "parcae-140m": 1.360, "parcae-370m": 4.174, "parcae-770m": 8.860, "parcae-1_3b": 15.834,
    "gpt-140m": 0.821, "gpt-370m": 2.416, "gpt-770m": 4.955, "gpt-1_3b": 8.607,
}


@pytest.mark.parametrize("name,published", sorted(PUBLISHED_GFLOP_PER_TOKEN.items()))
def test_reference_convention_reproduces_published_table(name, published):
    cfg = load_config(CONFIGS / f"{name}.yaml").model
    total = count_parameters(build_model(cfg, device="meta"))
    got = reference_flops_per_token(cfg, total) / 1e9
    print(f"{name}: {got:.3f} GFLOP/token (published {published:.3f})")
    assert abs(got - published) <= 0.0006


def test_our_convention_by_hand():
    cfg = ModelConfig(vocab_size=100, d_model=8, n_heads=2, n_prelude=1, n_core=2, n_coda=1, seq_len=4,
                      mu_rec=3, mu_bwd=1)
    d, s, v, f = 8, 4, 100, 32
    block = 4 * d * d + 2 * d * f  # q, k, v, proj + fc, proj
    gate = 2 * 32  # a value-embedding gate [kv heads, 32]: layers 1 and 3 of 4 (a core and the coda block)
    n_nc = 2 * block + gate + d * d + v * d + d * d  # prelude + coda + C + tied head + B (B e: once per forward)
    n_loop = 2 * block + gate  # the core; A_bar h is elementwise
    fm = FlopModel.of(cfg)
    assert fm.non_loop == 6 * n_nc + 12 * d * s * 2
    assert fm.step_nograd == 2 * n_loop + 4 * d * s * 2
    assert fm.step_grad == 6 * n_loop + 12 * d * s * 2
    causal = FlopModel.of(cfg, causal=True)
    assert causal.step_grad == 6 * n_loop + 6 * d * s * 2


def test_document_masking_scales_attention_by_the_share_of_pairs_kept():
    """model.doc_mask with rows of documents 5, 9 and 18 tokens in S = 32: a row keeps 25 + 81 + 324 = 430 of its
    32^2 = 1024 query-key pairs, so every attention term is 430/1024 of the full row's (both conventions) and the
    matmuls are unchanged; the share measured from such a row is that value; doc_mask off ignores the share."""
    import numpy as np

    from megaloop.model.documents import attention_share

    row = np.full((1, 32), 7)
    row[0, [0, 5, 14]] = 1  # BOS (id 1) at each document's start
    share = attention_share(row, 1)
    assert share == 430 / 1024
    sizes = dict(vocab_size=100, d_model=8, n_heads=2, n_prelude=1, n_core=2, n_coda=1, seq_len=32, mu_rec=3,
                 mu_bwd=1)
    full = FlopModel.of(ModelConfig(**sizes))
    masked = ModelConfig(**sizes, doc_mask=True, bos_id=1, doc_attention_share=share)
    fm = FlopModel.of(masked)
    d, s = 8, 32
    assert fm.step_grad == full.step_grad - 12 * d * s * 2 + 12 * d * 430 / s * 2  # 2 core layers, 12 d S each
    assert fm.step_nograd == full.step_nograd - 4 * d * s * 2 + 4 * d * 430 / s * 2
    assert fm.non_loop == full.non_loop - 12 * d * s * 2 + 12 * d * 430 / s * 2  # prelude + coda layer
    causal = FlopModel.of(masked, causal=True)
    assert causal.step_grad == full.step_grad - 12 * d * s * 2 + 6 * d * 430 / s * 2
    assert FlopModel.of(ModelConfig(**sizes, doc_attention_share=share)).step_grad == full.step_grad


def test_useful_and_executed_follow_depths():
    cfg = ModelConfig(vocab_size=100, d_model=8, n_heads=2, n_prelude=1, n_core=2, n_coda=1, seq_len=4)
    fm = FlopModel.of(cfg)
    n, k = torch.tensor([0, 3, 1]), torch.tensor([1, 2, 2])
    useful = fm.useful(n, k, 4)
    by_hand = 4 * sum(fm.non_loop + ni * fm.step_nograd + ki * fm.step_grad for ni, ki in [(0, 1), (3, 2), (1, 2)])
    assert useful == pytest.approx(by_hand, rel=1e-12)
    executed = fm.executed(n, k, 4)
    assert executed == pytest.approx(4 * 3 * (fm.non_loop + 3 * fm.step_nograd + 2 * fm.step_grad), rel=1e-12)
    assert executed > useful
    same = torch.tensor([2, 2, 2])
    assert fm.executed(same, same, 4) == pytest.approx(fm.useful(same, same, 4), rel=1e-12)


def test_flops_command_prints_the_flop_model_at_mu_rec(tmp_path):
    import json
    import subprocess
    import sys

    from megaloop.config import load_config
    from megaloop.train.flops import FlopModel

    config = str(Path(__file__).resolve().parents[2] / "configs" / "parcae-140m.yaml")
    sets = ["model.mu_rec=6", "data.shards=" + str(tmp_path / "absent")]  # the data need not exist
    done = subprocess.run([sys.executable, "-m", "megaloop", "flops", config, "--json", "--by-component"] +
                          [a for s in sets for a in ("--set", s)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    m = load_config(config, sets, validate=False).model
    assert got["mu_rec"] == 6 and got["mu_bwd"] == 4 == m.backprop_depth  # parcae-140m keeps mu_bwd 4
    # 2 forward-only loop steps and 4 with gradient at the mean depth 6
    fm = FlopModel.of(m)
    assert got["flops_per_token"] == fm.non_loop + 2 * fm.step_nograd + 4 * fm.step_grad
    assert got["gflop_per_token"] == pytest.approx(got["flops_per_token"] / 1e9, rel=1e-12)
    rows = [c["name"] for c in got["components"]]  # 2 laps without gradient, then 4 with
    assert rows == ["prelude", "injection"] + [f"lap {i} (no grad)" for i in (1, 2)] + \
        [f"lap {i} (grad)" for i in (3, 4, 5, 6)] + ["coda", "head"]
    assert sum(c["gflop_per_token"] for c in got["components"]) == pytest.approx(got["gflop_per_token"], rel=1e-12)
    assert got["tokens_per_step"] == 256 * 2048  # data.global_batch_size x model.seq_len of parcae-140m
    bad = subprocess.run([sys.executable, "-m", "megaloop", "flops", config, "--set", "model.mu_rec=0"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "model.mu_rec" in bad.stderr


def test_flops_command_depth_and_reference_convention(capsys):
    import json

    from megaloop.__main__ import main

    config = str(CONFIGS / "parcae-140m.yaml")
    m = load_config(config, validate=False).model
    total = count_parameters(build_model(m, device="meta"))
    for depth, (n, k) in ((1, (0, 1)), (8, (4, 4)), (12, (8, 4))):
        assert main(["flops", config, "--json", "--depth", str(depth), "--convention", "reference"]) == 0
        got = json.loads(capsys.readouterr().out)
        assert (got["laps_nograd"], got["laps_grad"]) == (n, k)
        assert got["flops_per_token"] == reference_flops_per_token(m, total, depth)
    assert got["gflop_per_token"] > PUBLISHED_GFLOP_PER_TOKEN["parcae-140m"]  # T 12 > mu_rec 8
    assert main(["flops", config, "--depth", "0"]) == 2
    assert "--depth" in capsys.readouterr().err


def test_injection_term_of_e_is_outside_the_loop():
    """B e (Parcae) and W_2 e (RDM) run once per forward: the non-loop part; RDM's W_1 h runs every lap."""
    kw = dict(vocab_size=100, d_model=8, n_heads=2, n_prelude=1, n_core=1, n_coda=1, seq_len=4)
    parcae, additive = FlopModel.of(ModelConfig(**kw)), FlopModel.of(ModelConfig(**kw, injection="additive"))
    assert parcae.non_loop - additive.non_loop == 6 * 8 * 8 and parcae.step_grad == additive.step_grad
    rdm = FlopModel.of(ModelConfig(**kw, arch="rdm", injection="concat", block="sandwich", use_C=False))
    plain = FlopModel.of(ModelConfig(**kw, injection="additive", use_C=False, block="sandwich"))
    assert rdm.non_loop - plain.non_loop == 6 * 8 * 8 and rdm.step_grad - plain.step_grad == 6 * 8 * 8
    assert [c.name for c in rdm.components(1, 1)] == ["prelude", "injection", "lap 1 (no grad)", "lap 2 (grad)",
                                                      "coda", "head"]
