"""Approximate orthogonalisation of a matrix by the Polar Express iteration (Muon's core).

For G = U S V^T the target is the polar factor U V^T. Each iteration applies the odd polynomial
p(x) = a x + b x^3 + c x^5 to the singular values without an SVD:

    tall (rows > cols):   A = X^T X  (cols x cols),  X <- a X + X (b A + c A^2)
    wide (rows <= cols):  A = X X^T  (rows x rows),  X <- a X + (b A + c A^2) X

Both forms are the same polynomial (X (X^T X)^k = (X X^T)^k X); the branch only picks the smaller Gram matrix, so
the cost is O(rows * cols * min(rows, cols)). Square matrices take the wide form.

Precision: the Frobenius normalisation X = G / (1.02 ||G||_F + 1e-6) is computed in G's dtype (fp32 in Muon), the
result is rounded once to ``dtype`` (bf16 by default, as in the reference) and all iterations run in that dtype
(matmuls accumulate in fp32 inside the kernels, every product is rounded to bf16). The result is returned in G's
dtype. With dtype=torch.float64 the same code is a float64 reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

# (a, b, c) per iteration, from the reference (PARCAE_REFERENCE.md section 7). The 1.02 safety factor of the
# normalisation keeps the largest singular value slightly below 1, where the first, aggressive polynomial is safe.
POLAR_EXPRESS_COEFFS: tuple[tuple[float, float, float], ...] = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
NORM_SAFETY = 1.02
NORM_EPS = 1e-6


def is_tall(shape: torch.Size | tuple[int, ...]) -> bool:
    """True when the matrix has more rows than columns (then X^T X is the small Gram matrix)."""
    rows, cols = shape[-2], shape[-1]
    return rows > cols


def polar_express(grad: Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Return an approximately orthogonal matrix with the singular vectors of the 2-D tensor ``grad``.

    ``steps`` (1..5) iterations use the first ``steps`` coefficient triples. The output has ``grad``'s dtype and
    singular values near 1 (roughly 0.7..1.2 after 5 bf16 steps for full-rank input; exact zeros stay zero).
    """
    if grad.ndim != 2:
        raise ValueError(f"polar_express needs a 2-D matrix, got shape {tuple(grad.shape)}")
    if not 1 <= steps <= len(POLAR_EXPRESS_COEFFS):
        raise ValueError(f"steps = {steps} is invalid: allowed values are 1..{len(POLAR_EXPRESS_COEFFS)}")
    x = grad / (grad.norm() * NORM_SAFETY + NORM_EPS)
    x = x.to(dtype)
    tall = is_tall(x.shape)
    for a, b, c in POLAR_EXPRESS_COEFFS[:steps]:
        if tall:
            gram = x.mT @ x
            x = a * x + x @ (b * gram + c * (gram @ gram))
        else:
            gram = x @ x.mT
            x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x.to(grad.dtype)
