"""The analytical FLOPs against torch.utils.flop_counter.FlopCounterMode on real models (a cheap subset; the whole
matrix, GPT and Parcae at T 1/4/8 with and without truncated backprop at larger sizes, is
benchmarks/flops_counter.py): within 2% per component."""
import pytest

from megaloop.config import ModelConfig
from megaloop.model import build_model
from megaloop.train.flop_count import GROUPS, analytical_groups, compare

SMALL = dict(vocab_size=256, d_model=64, n_heads=2, n_prelude=1, n_core=2, n_coda=1, seq_len=32)
PARCAE = ModelConfig(**SMALL, mu_rec=4, mu_bwd=2)
GPT = ModelConfig(**SMALL, arch="gpt", injection="none", mu_rec=1, mu_bwd=1, prelude_norm=False, use_C=False)
RDM = ModelConfig(**SMALL, arch="rdm", injection="concat", block="sandwich", use_C=False, mu_rec=4, mu_bwd=2)


@pytest.mark.parametrize("cfg,n,k", [(PARCAE, 0, 1), (PARCAE, 2, 2), (PARCAE, 0, 4), (GPT, 0, 0), (RDM, 2, 2)],
                         ids=["parcae-T1", "parcae-T4-truncated", "parcae-T4-full", "gpt", "rdm-T4-truncated"])
def test_analytical_flops_match_the_counter_per_component(cfg, n, k):
    rows = compare(cfg, n, k, build_model(cfg))
    for name, want, got, err in rows:
        print(f"{name:<10} analytical {want:>12.0f} counted {got:>12.0f} rel err {err:.2e}")
    assert {r[0] for r in rows} >= {"prelude", "head", "attention", "backward"}
    assert all(err <= 0.02 for *_, err in rows), rows


def test_counter_comparison_can_fail():
    """A FLOP model that forgot the head's backward would be caught: the comparison is not vacuous."""
    want = analytical_groups(PARCAE, 2, 2)
    assert set(want) == set(GROUPS) and want["laps"] > 0 and want["backward"] > 0
    head_backward = 4 * PARCAE.vocab_size * PARCAE.d_model
    assert head_backward / want["backward"] > 0.02  # larger than the tolerance
