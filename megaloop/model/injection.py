"""How the loop state h and the prelude output e are mixed before the core: u = inject(h, e).

diagonal (Parcae): u = A_bar * h + Delta * (B e), A_bar = exp(-Delta * A), A = exp(A_log), Delta = softplus(dt_bias):
  a zero-order-hold discretisation of a negative diagonal A, so every entry of A_bar is in (0, 1) and rho(A_bar) < 1.
additive: u = h + e (A = I, marginally stable).  concat (RDM / Huginn): u = W [h; e], W = [W_1 | W_2].

The loop splits u into a term of e, computed once per forward (input_term: Delta * (B e), W_2 e or e), and the
per-lap step(h, term, coeffs) with coeffs = state_coeffs() also computed once per forward (A_bar for diagonal).
Both go through the module call, `injection(None, e)` -> (term, coeffs) once and `injection(h, prepared=(term,
coeffs))` per lap, never through the methods directly: engines that gather a module's parameters only around its
forward (DeepSpeed ZeRO-3) must see every use of them. rho_tensor() is the spectral radius as a detached 0-dim
tensor, for telemetry without a host sync.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megaloop.model.layers import upcast

_BELOW_ONE = 1.0 - 2.0 ** -24  # the largest float32 below 1


class DiagonalInjection(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.A_log = nn.Parameter(torch.zeros(d))
        self.dt_bias = nn.Parameter(torch.zeros(d))
        self.B = nn.Parameter(torch.empty(d, d))

    def discretised(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(A_bar, Delta), computed in (at least) fp32.

        exp(-x) < 1 for every x > 0, but in fp32 it rounds to exactly 1 once Delta*A < 6e-8 (e.g. A_log -> -20).
        A_bar's value is therefore capped at the largest float below 1, with the gradient passed straight through
        (so a parameter that reaches the cap is not frozen): rho(A_bar) < 1 holds in floating point too."""
        delta = F.softplus(upcast(self.dt_bias))
        a_bar = torch.exp(-delta * torch.exp(upcast(self.A_log)))
        capped = a_bar.clamp(max=_BELOW_ONE)
        return a_bar + (capped - a_bar).detach(), delta

    def forward(self, h: torch.Tensor | None, e: torch.Tensor | None = None, prepared=None):
        return _inject(self, h, e, prepared)

    def input_term(self, e: torch.Tensor) -> torch.Tensor:
        """Delta * (B e), the part of u that does not depend on h."""
        delta = self.discretised()[1]
        return delta.to(e.dtype) * (e @ self.B.t().to(e.dtype))

    def state_coeffs(self) -> torch.Tensor:
        return self.discretised()[0]

    def step(self, h: torch.Tensor, term: torch.Tensor, a_bar: torch.Tensor) -> torch.Tensor:
        return h * a_bar.to(h.dtype) + term

    @torch.no_grad()
    def rho_tensor(self) -> torch.Tensor:
        return self.discretised()[0].max()

    def spectral_radius(self) -> float:
        return float(self.rho_tensor())


class AdditiveInjection(nn.Module):
    def forward(self, h: torch.Tensor | None, e: torch.Tensor | None = None, prepared=None):
        return _inject(self, h, e, prepared)

    def input_term(self, e: torch.Tensor) -> torch.Tensor:
        return e

    def state_coeffs(self) -> None:
        return None

    def step(self, h: torch.Tensor, term: torch.Tensor, _coeffs=None) -> torch.Tensor:
        return h + term

    def rho_tensor(self) -> torch.Tensor:
        return torch.tensor(1.0)

    def spectral_radius(self) -> float:
        return 1.0


class ConcatInjection(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.d = d
        self.W = nn.Linear(2 * d, d, bias=False)
        self._rho_cache: tuple[torch.Tensor, float] | None = None  # (the W_1 it was computed from, rho)

    def forward(self, h: torch.Tensor | None, e: torch.Tensor | None = None, prepared=None):
        return _inject(self, h, e, prepared)

    def input_term(self, e: torch.Tensor) -> torch.Tensor:
        """W_2 e, the part of u that does not depend on h."""
        return F.linear(e, self.W.weight[:, self.d:])

    def state_coeffs(self) -> None:
        return None

    def step(self, h: torch.Tensor, term: torch.Tensor, _coeffs=None) -> torch.Tensor:
        return F.linear(h, self.W.weight[:, : self.d]) + term

    def rho_tensor(self) -> torch.Tensor:
        """rho(W_1) as a 0-dim CPU tensor; computed again only when W_1 has changed (once per optimizer step)."""
        return torch.tensor(self.spectral_radius(), dtype=upcast(self.W.weight.detach()[:0]).dtype)

    @torch.no_grad()
    def spectral_radius(self) -> float:
        """rho(W_1), the state-to-state block; cached while W_1 holds the same values (eigvals of d x d is not free).

        The cache is keyed on W_1's values (a copy, compared exactly on its device), not on the parameter's version
        counter: a parameter whose storage is a view of a flat buffer (the data-parallel gradient buffer, ZeRO-1's
        all-gather) changes through other views of that storage without its own counter moving."""
        w1 = self.W.weight[:, : self.d].detach()
        if self._rho_cache is None or not _same_values(self._rho_cache[0], w1):
            self._rho_cache = (w1.clone(), float(torch.linalg.eigvals(w1.double().cpu()).abs().max()))
        return self._rho_cache[1]


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold exactly the same values (same shape, dtype and device)."""
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)


def _inject(module: nn.Module, h, e, prepared):
    """The forward of every injection: h None -> (term of e, state coefficients), computed once per model forward
    (the term is None when e is None: the coefficients alone, for a pipeline stage that keeps the term and needs
    the coefficients' gradient in every lap); otherwise u = step(h, term, coeffs) from `prepared` (or from e,
    computing the term on the spot)."""
    if h is None:
        return (None if e is None else module.input_term(e)), module.state_coeffs()
    term, coeffs = prepared if prepared is not None else (module.input_term(e), module.state_coeffs())
    return module.step(h, term, coeffs)


def build_injection(kind: str, d: int) -> nn.Module | None:
    if kind == "diagonal":
        return DiagonalInjection(d)
    if kind == "additive":
        return AdditiveInjection()
    if kind == "concat":
        return ConcatInjection(d)
    if kind == "none":
        return None
    raise ValueError(f"unknown injection {kind!r}: allowed diagonal, additive, concat, none")


def dt_bias_init(decay: float = 1.0 / math.sqrt(5.0)) -> float:
    """softplus^-1(-ln decay): with A = 1, A_bar starts at `decay` (1/sqrt 5 in the reference)."""
    y = -math.log(decay)
    return y + math.log(-math.expm1(-y))
