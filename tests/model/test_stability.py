"""Rho(A_bar) < 1 for all parameter values; additive injection has A = I; RDM reports rho(W_1)."""
import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megaloop.model import build_model
from megaloop.model.injection import AdditiveInjection, DiagonalInjection
from tests.model.helpers import small_config

finite = st.floats(min_value=-80.0, max_value=80.0, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(a_log=st.lists(finite, min_size=4, max_size=4), dt_bias=st.lists(finite, min_size=4, max_size=4))
def test_spectral_radius_below_one_for_any_parameters(a_log, dt_bias):
    inj = DiagonalInjection(4)
    with torch.no_grad():
        inj.A_log.copy_(torch.tensor(a_log))
        inj.dt_bias.copy_(torch.tensor(dt_bias))
    a_bar, delta = inj.discretised()
    assert torch.all(a_bar >= 0) and torch.all(delta >= 0)
    assert torch.all(a_bar < 1.0)
    assert inj.spectral_radius() < 1.0


def test_spectral_radius_extremes():
    inj = DiagonalInjection(6)
    with torch.no_grad():
        inj.A_log.copy_(torch.tensor([-20.0, 20.0, 0.0, -5.0, 3.0, 0.0]))
        inj.dt_bias.copy_(torch.tensor([20.0, -20.0, 0.0, 5.0, -3.0, -10.0]))
    a_bar, _ = inj.discretised()
    dt, alog = inj.dt_bias.detach().double().numpy(), inj.A_log.detach().double().numpy()
    expected = np.exp(-np.logaddexp(0.0, dt) * np.exp(alog))
    assert np.allclose(a_bar.detach().double().numpy(), expected, rtol=1e-5, atol=1e-7)
    # the first channel has Delta*A = 4e-8: exp rounds to 1 in fp32, the cap keeps it strictly below
    assert inj.spectral_radius() == float(a_bar.detach().max()) and inj.spectral_radius() < 1.0
    a_bar.sum().backward()
    assert torch.isfinite(inj.A_log.grad).all() and inj.A_log.grad[0] != 0, "gradient passes the cap"


def test_additive_injection_is_identity_dynamics():
    inj = AdditiveInjection()
    h, e = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    assert torch.equal(inj(h, e), h + e)
    # A = I: the state passes with gain exactly 1
    assert torch.equal(inj(h, torch.zeros_like(e)), h)
    assert inj.spectral_radius() == 1.0


def test_rdm_reports_spectral_radius_of_w1():
    cfg = small_config(arch="rdm", injection="concat", block="sandwich", use_C=False)
    model = build_model(cfg)
    w = model.injection.W.weight
    with torch.no_grad():
        w1 = torch.diag(torch.linspace(-1.7, 0.5, cfg.d_model))
        w.copy_(torch.cat([w1, 0.1 * torch.randn(cfg.d_model, cfg.d_model)], dim=1))
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    out = model(ids, depth=2)
    assert abs(out.telemetry["rho_W1"] - 1.7) < 1e-5
    with torch.no_grad():
        w[:, : cfg.d_model] *= 0.5  # the cache must follow the weight
    assert abs(model(ids, depth=2).telemetry["rho_W1"] - 0.85) < 1e-5


def test_parcae_telemetry_reports_rho_of_a_bar():
    model = build_model(small_config())
    ids = torch.randint(0, 256, (2, 16))
    out = model(ids, depth=3)
    a_bar, _ = model.injection.discretised()
    assert out.telemetry["rho_A"] == float(a_bar.detach().max()) < 1.0
    assert out.telemetry["executed_steps"] == 3 and out.telemetry["useful_steps"] == 6
    assert out.telemetry["state_norm"] > 0 and out.telemetry["recurrent_residual"] > 0
