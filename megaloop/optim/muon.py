"""Muon with NorMuon's factored second moment and cautious weight decay, as the Parcae reference uses it.

The per-matrix math is a pair of pure functions so that a distributed Muon can split the work: the rank that owns a
matrix calls :func:`muon_update` (momentum, Polar Express, NorMuon) on the full gradient and broadcasts the update;
every rank holding a copy or a shard of the parameter then calls :func:`apply_muon_update` (cautious decoupled
weight decay + learning rate), which only needs the parameter and the update elementwise.

One step for a matrix P (rows x cols) with gradient G, momentum mu, NorMuon beta2, learning rate lr, decay wd:

    M <- mu M + (1 - mu) G                                  momentum buffer (an EMA, as in the reference)
    U <- (1 - mu) G + mu M   (Nesterov)  or  U <- M         the direction fed to the orthogonalisation
    O <- PolarExpress(U)                                    bf16 iterations, see orthogonalize.py
    r <- mean of O^2 over cols (one per row) if rows >= cols, else over rows (one per column)
    V <- beta2 V + (1 - beta2) r                            NorMuon second moment (no bias correction: it cancels)
    N <- O / sqrt(max(V, 1e-10));  N <- N * ||O||_F / max(||N||_F, 1e-10)     Frobenius norm of O preserved
    lr_eff = lr * sqrt(max(1, rows / cols))
    P <- P - lr_eff * (N + wd * P * [N * P >= 0])          cautious decoupled weight decay

State (fp32 for fp32/bf16/fp16 parameters, float64 for float64 ones): ``momentum_buffer`` [rows, cols] and
``second_moment`` [rows, 1] or [1, cols]. Everything after the Polar Express runs in that state dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch
from torch import Tensor

from .orthogonalize import polar_express

SECOND_MOMENT_FLOOR = 1e-10


@dataclass(frozen=True)
class MuonHParams:
    """Hyperparameters of one :func:`muon_update` call (momentum is the scheduled value for this step)."""

    momentum: float
    nesterov: bool = True
    beta2: float = 0.95
    ns_steps: int = 5
    orth_dtype: torch.dtype = torch.bfloat16


def check_matrix(shape: torch.Size | tuple[int, ...], name: str = "parameter") -> None:
    """Raise ValueError unless ``shape`` is 2-D: Muon orthogonalises matrices only."""
    if len(shape) != 2:
        raise ValueError(
            f"Muon handles 2-D weight matrices only, but {name} has shape {tuple(shape)}; "
            "reshape it to 2-D in the model or route it to AdamW in megaloop.optim.grouping"
        )


def state_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """Dtype of Muon's buffers for a parameter dtype: at least fp32."""
    return torch.promote_types(param_dtype, torch.float32)


def reduces_over_cols(shape: torch.Size | tuple[int, ...]) -> bool:
    """True when NorMuon keeps one second moment per row (rows >= cols), False for one per column."""
    return shape[-2] >= shape[-1]


def init_muon_state(param: Tensor) -> dict[str, Tensor]:
    """Fresh (zero) Muon state for a 2-D parameter."""
    check_matrix(param.shape)
    rows, cols = param.shape
    dtype = state_dtype(param.dtype)
    moment_shape = (rows, 1) if reduces_over_cols(param.shape) else (1, cols)
    return {
        "momentum_buffer": torch.zeros(rows, cols, dtype=dtype, device=param.device),
        "second_moment": torch.zeros(moment_shape, dtype=dtype, device=param.device),
    }


def muon_lr_scale(shape: torch.Size | tuple[int, ...]) -> float:
    """The shape factor sqrt(max(1, rows / cols)) applied to Muon's learning rate (and so to its weight decay)."""
    rows, cols = shape[-2], shape[-1]
    return math.sqrt(max(1.0, rows / cols))


def normuon_rescale(ortho: Tensor, second_moment: Tensor, beta2: float) -> Tensor:
    """NorMuon: update the factored second moment in place and return the rescaled, norm-preserving update."""
    reduce_dim = -1 if reduces_over_cols(ortho.shape) else -2
    mean_sq = ortho.square().mean(dim=reduce_dim, keepdim=True)
    second_moment.lerp_(mean_sq, 1.0 - beta2)
    scaled = ortho * second_moment.clamp_min(SECOND_MOMENT_FLOOR).rsqrt()
    scale = ortho.norm() / scaled.norm().clamp_min(SECOND_MOMENT_FLOOR)
    return scaled * scale


@torch.no_grad()
def muon_update(grad: Tensor, state: dict[str, Tensor], hparams: MuonHParams) -> Tensor:
    """Advance ``state`` (in place) by one gradient and return the normalised update direction (state dtype).

    The update is what :func:`apply_muon_update` subtracts after multiplying by the effective learning rate; it
    depends only on the gradient, the state and the hyperparameters (never on the parameter), so one rank can
    compute it and broadcast it.
    """
    check_matrix(grad.shape, "the gradient")
    momentum_buffer = state["momentum_buffer"]
    if momentum_buffer.shape != grad.shape:
        raise ValueError(f"Muon state of shape {tuple(momentum_buffer.shape)} given a gradient {tuple(grad.shape)}")
    grad = grad.to(momentum_buffer.dtype)
    momentum_buffer.lerp_(grad, 1.0 - hparams.momentum)
    direction = grad.lerp(momentum_buffer, hparams.momentum) if hparams.nesterov else momentum_buffer
    ortho = polar_express(direction, steps=hparams.ns_steps, dtype=hparams.orth_dtype)
    return normuon_rescale(ortho, state["second_moment"], hparams.beta2)


@torch.no_grad()
def apply_muon_update(param: Tensor, update: Tensor, lr: float, weight_decay: float) -> None:
    """P <- P - lr * (update + weight_decay * P * [update * P >= 0]), in place; ``lr`` already includes the shape
    factor (see :func:`muon_lr_scale`). Works on any elementwise-matching shard of the parameter and update."""
    work = param.to(update.dtype)
    decay_mask = (update * work) >= 0
    delta = update + weight_decay * work * decay_mask
    if param.dtype == update.dtype:
        param.sub_(delta, alpha=lr)
    else:
        param.copy_(work.sub_(delta, alpha=lr))


class Muon(torch.optim.Optimizer):
    """Muon over a list of 2-D parameters; every matrix is updated by :func:`muon_update` then
    :func:`apply_muon_update`.

    The group entries ``lr``, ``momentum`` and ``weight_decay`` are the values for the coming step; a schedule
    (see :class:`megaloop.optim.combined.CombinedOptimizer`) rewrites them before each step. Parameters whose
    ``grad`` is None are skipped (their state is untouched). ``orth_dtype`` (an attribute, not saved) selects the
    Polar Express precision: bf16 as in the reference; float64 turns the whole step into a float64 reference.
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float = 8e-3,
        momentum: float = 0.95,
        weight_decay: float = 0.0,
        beta2: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        orth_dtype: torch.dtype = torch.bfloat16,
    ):
        params = list(params)
        for index, param in enumerate(params):
            check_matrix(param.shape, f"Muon parameter #{index}")
        defaults = dict(
            lr=lr, momentum=momentum, weight_decay=weight_decay, beta2=beta2, nesterov=nesterov, ns_steps=ns_steps
        )
        super().__init__(params, defaults)
        self.orth_dtype = orth_dtype

    def _state_for(self, param: Tensor) -> dict[str, Tensor]:
        """The parameter's state, created on first use and kept at least fp32 (a loaded state dict may have been
        cast to the parameter's dtype by torch's loader)."""
        state = self.state[param]
        if not state:
            state.update(init_muon_state(param))
        wanted = state_dtype(param.dtype)
        for key in ("momentum_buffer", "second_moment"):
            if state[key].dtype != wanted:
                state[key] = state[key].to(wanted)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        """One Muon step over every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            hparams = MuonHParams(
                momentum=group["momentum"],
                nesterov=group["nesterov"],
                beta2=group["beta2"],
                ns_steps=group["ns_steps"],
                orth_dtype=self.orth_dtype,
            )
            for param in group["params"]:
                if param.grad is None:
                    continue
                update = muon_update(param.grad, self._state_for(param), hparams)
                lr = group["lr"] * muon_lr_scale(param.shape)
                apply_muon_update(param, update, lr, group["weight_decay"])
        return loss
