"""the bf16 Polar Express equals an independent float64 implementation of the same iteration.

Tolerances (bf16 has a unit roundoff of 2^-9 ~ 2e-3; the first iteration adds terms of size |a|+|b|+|c| ~ 46 that
cancel to ~1, so each iteration loses a few 1e-3 to 1e-2 relatively): relative Frobenius error <= 0.08 (measured
<= 0.052 on these shapes over 10 seeds), max abs difference / ||reference||_F <= 2e-2 (measured <= 0.003),
bf16 singular values in [0.80, 1.20] (measured [0.853, 1.145]). The same code run in float64 must match the
reference to 1e-12, which pins every coefficient, the 1.02 / 1e-6 normalisation and the tall/wide forms exactly.
"""

import pytest
import torch

from megaloop.optim import polar_express

# The five (a, b, c) triples, typed in from PARCAE_REFERENCE.md section 7 (not imported from the code under test).
COEFFS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]
REL_FRO_TOL = 0.08
MAX_ABS_TOL = 2e-2
SV_BAND = (0.80, 1.20)


def reference_polar_express(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Float64 Polar Express written from the formula, always through the odd polynomial in X^T X.

    For a wide matrix this is X (X^T X)^k, the large-Gram form, which equals (X X^T)^k X exactly: so the
    reference is independent of the code's choice of branch.
    """
    x = g.double() / (1.02 * torch.linalg.matrix_norm(g.double()) + 1e-6)
    for a, b, c in COEFFS[:steps]:
        gram = x.T @ x
        x = a * x + b * (x @ gram) + c * (x @ gram @ gram)
    return x


def matrix_with_spectrum(rows: int, cols: int, seed: int, low: float) -> torch.Tensor:
    """Random singular vectors with singular values log-spaced in [low, 1]."""
    gen = torch.Generator().manual_seed(seed)
    k = min(rows, cols)
    u, _ = torch.linalg.qr(torch.randn(rows, k, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(cols, k, generator=gen, dtype=torch.float64))
    s = torch.logspace(torch.log10(torch.tensor(low)).item(), 0.0, k, dtype=torch.float64)
    return (u * s) @ v.T


def gaussian(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# A square Gaussian matrix has singular values down to ~0, below Polar Express's design range, so the square case
# uses a controlled spectrum in [1e-2, 1] (tall/wide Gaussians are well inside the range).
CASES = {
    "tall 256x64": lambda seed: gaussian(256, 64, seed),
    "wide 64x256": lambda seed: gaussian(64, 256, seed),
    "square 128x128": lambda seed: matrix_with_spectrum(128, 128, seed, 1e-2),
    "tall 96x48 ill-conditioned": lambda seed: matrix_with_spectrum(96, 48, seed, 1e-2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_polar_express_matches_float64_reference(case):
    for seed in range(3):
        g = CASES[case](seed)
        ours = polar_express(g.float()).double()  # fp32 in, bf16 iterations, fp32 out: as Muon calls it
        ref = reference_polar_express(g)
        rel_fro = (torch.linalg.matrix_norm(ours - ref) / torch.linalg.matrix_norm(ref)).item()
        max_abs = ((ours - ref).abs().max() / torch.linalg.matrix_norm(ref)).item()
        sv = torch.linalg.svdvals(ours)
        sv_ref = torch.linalg.svdvals(ref)
        print(
            f"polar express {case} seed {seed}: rel Frobenius err {rel_fro:.4f} (tol {REL_FRO_TOL}), "
            f"max|diff|/||ref||_F {max_abs:.5f} (tol {MAX_ABS_TOL}), bf16 singular values "
            f"[{sv.min():.3f}, {sv.max():.3f}], float64 [{sv_ref.min():.3f}, {sv_ref.max():.3f}]"
        )
        assert ours.shape == g.shape
        assert rel_fro <= REL_FRO_TOL
        assert max_abs <= MAX_ABS_TOL
        assert SV_BAND[0] <= sv.min() and sv.max() <= SV_BAND[1]


@pytest.mark.parametrize("shape", [(40, 12), (12, 40), (24, 24)])
@pytest.mark.parametrize("steps", [1, 3, 5])
def test_float64_mode_equals_reference_exactly(shape, steps):
    g = gaussian(*shape, seed=7)
    ours = polar_express(g, steps=steps, dtype=torch.float64)
    ref = reference_polar_express(g, steps=steps)
    err = (ours - ref).abs().max().item()
    assert ours.dtype == torch.float64
    assert err <= 1e-12, f"float64 Polar Express differs from the reference by {err:.3e}"


def test_transpose_equivariance_in_bf16():
    g = gaussian(200, 50, seed=3).float()
    tall = polar_express(g)
    wide = polar_express(g.T.contiguous()).T
    rel = (torch.linalg.matrix_norm(tall - wide) / torch.linalg.matrix_norm(tall)).item()
    assert rel <= REL_FRO_TOL


def test_zero_matrix_and_bad_inputs():
    assert torch.equal(polar_express(torch.zeros(8, 4)), torch.zeros(8, 4))
    with pytest.raises(ValueError, match="2-D"):
        polar_express(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="1..5"):
        polar_express(torch.zeros(3, 3), steps=6)


@pytest.mark.parametrize("shape", [(512, 16), (16, 512)])
def test_uses_the_small_gram_matrix(shape):
    """Both forms give the same matrix, so only the cost shows the branch: with k = min(rows, cols) and
    n = max(rows, cols), 5 iterations with the k x k Gram matrix cost 5 (4 n k^2 + 2 k^3) matmul FLOPs, against
    5 (4 k n^2 + 2 n^3) with the n x n one."""
    from torch.utils.flop_counter import FlopCounterMode

    k, n = min(shape), max(shape)
    with FlopCounterMode(display=False) as counter:
        polar_express(torch.randn(shape))
    small_gram = 5 * (4 * n * k * k + 2 * k**3)
    print(f"polar_express {shape}: {counter.get_total_flops():,} matmul FLOPs (small-Gram form {small_gram:,})")
    assert counter.get_total_flops() == small_gram
