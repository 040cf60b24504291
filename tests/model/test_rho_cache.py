"""The RDM injection's rho(W_1) cache follows W_1's values, however they change: a parameter rewired into a flat
buffer (the data-parallel gradient buffer) is written through other views of that storage, which leave the
parameter's own version counter where it was."""
import torch

from megaloop.model.injection import ConcatInjection

D = 6
EIGVALS = torch.linalg.eigvals  # the reference's, untouched by the call counting below


def rho_of(w1: torch.Tensor) -> float:
    """The reference: the largest eigenvalue modulus of W_1, computed here independently of the module."""
    return float(EIGVALS(w1.detach().double()).abs().max())


def test_rho_follows_writes_through_another_view_of_the_storage():
    inj = ConcatInjection(D)
    flat = torch.zeros(D * 2 * D + 3)  # a flat buffer holding the weight at an offset, as the gradient buffer does
    with torch.no_grad():
        inj.W.weight.data = flat[3:].view(D, 2 * D)
        flat[3:].view(D, 2 * D)[:, :D] = torch.diag(torch.linspace(-1.5, 0.5, D))
    assert abs(inj.spectral_radius() - 1.5) < 1e-12
    version = inj.W.weight._version
    other = flat[3:].view(D, 2 * D)  # e.g. the all-gather writing the updated chunk into the buffer
    other[:, :D] = torch.diag(torch.linspace(-0.25, 0.75, D))
    assert inj.W.weight._version == version  # the old key (the parameter's version) did not move
    assert abs(inj.spectral_radius() - 0.75) < 1e-12
    assert abs(float(inj.rho_tensor()) - rho_of(inj.W.weight[:, :D])) < 1e-6  # the float32 telemetry copy


def test_rho_is_cached_while_the_values_stay_and_recomputed_on_any_change(monkeypatch):
    torch.manual_seed(0)
    inj = ConcatInjection(D)
    calls = []
    monkeypatch.setattr(torch.linalg, "eigvals", lambda m: calls.append(1) or EIGVALS(m))
    first = inj.spectral_radius()
    assert inj.spectral_radius() == first and len(calls) == 1  # same values: no second eigendecomposition
    with torch.no_grad():
        inj.W.weight[0, 0] += 1.0  # in place through the parameter itself
    assert abs(inj.spectral_radius() - rho_of(inj.W.weight[:, :D])) < 1e-12 and len(calls) == 2
    with torch.no_grad():
        inj.W.weight[:, D:] += 1.0  # W_2 only: rho(W_1) is unchanged and not recomputed
    assert inj.spectral_radius() == rho_of(inj.W.weight[:, :D]) and len(calls) == 2
