"""Rotations along head_dim: spread outlier channels before quantizing, leave q . k unchanged.

For an orthogonal R (R R^T = I), (q R) . (k R) = q R R^T k^T = q . k: attention scores do not change
when both are rotated. But a key with one huge channel becomes, after a Hadamard rotation, a vector whose
energy is spread evenly over all channels, so a per-token scale no longer has to cover one outlier.
The cache stores rotated keys; the query is rotated the same way before attention. V is not rotated.

- hadamard: Sylvester's construction, entries +-1 / sqrt(n), n a power of two;
- orthogonal: a random orthogonal matrix (QR of a seeded Gaussian, signs fixed so it is unique).
"""
from __future__ import annotations

import torch

from radarlab.quant.formats import ROTATIONS
from radarlab.util import require_int, require_power_of_two


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The n x n normalized Hadamard matrix (symmetric and orthogonal: H H = I)."""
    n = require_power_of_two("n (Hadamard size)", n)
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / n**0.5).to(dtype)


def random_orthogonal(n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A seeded random orthogonal n x n matrix (Haar-distributed)."""
    n = require_int("n", n)
    g = torch.Generator().manual_seed(require_int("seed", seed, minimum=0))
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))[None, :]).to(dtype)


def rotation_matrix(kind: str, n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """hadamard or orthogonal, n x n."""
    if kind == "hadamard":
        return hadamard_matrix(n, dtype)
    if kind == "orthogonal":
        return random_orthogonal(n, seed, dtype)
    raise ValueError(f"rotation must be one of {', '.join(ROTATIONS)}, got {kind!r}")


def rotate(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """x [..., n] times the rotation (computed in fp32, returned in x's dtype)."""
    if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1] or matrix.shape[0] != x.shape[-1]:
        raise ValueError(f"rotation must be [{x.shape[-1]}, {x.shape[-1]}] to act on the last axis of "
                         f"{tuple(x.shape)}, got {tuple(matrix.shape)}")
    return (x.float() @ matrix.to(x.device, torch.float32)).to(x.dtype)
