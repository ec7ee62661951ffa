"""Pearson's chi-square goodness-of-fit test, and its power: how a sampler is shown to be lossless.

Draw n tokens with the sampler, count them in bins (say the target's top tokens and one "other"
bin), and compare with n times the target's probabilities. Under the null hypothesis (the sampler
draws from p) the statistic follows a chi-square law with bins - 1 degrees of freedom, so a small
p-value rejects it. The power, the chance of rejecting a sampler that really draws from b != p, is
that of a noncentral chi-square with noncentrality n * sum((b - p)^2 / p): the test can be sized to
catch a given bias before it is run.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch


def _probs(probs: Sequence[float], name: str) -> torch.Tensor:
    p = torch.as_tensor(probs, dtype=torch.float64).flatten()
    if p.numel() < 2 or bool((p <= 0).any()) or abs(float(p.sum()) - 1) > 1e-6:
        raise ValueError(f"{name} must be >= 2 positive probabilities summing to 1, got {p.tolist()}")
    return p


def chi_square_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square(df): the p-value."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def chi_square_test(counts: Sequence[int], probs: Sequence[float]) -> tuple[float, float]:
    """(statistic, p-value) of observed bin counts against bin probabilities."""
    p = _probs(probs, "probs")
    c = torch.as_tensor(counts, dtype=torch.float64).flatten()
    if c.shape != p.shape:
        raise ValueError(f"{c.numel()} counts for {p.numel()} probabilities")
    expected = c.sum() * p
    statistic = float(((c - expected) ** 2 / expected).sum())
    return statistic, chi_square_sf(statistic, p.numel() - 1)


def critical_value(df: int, alpha: float) -> float:
    """The statistic whose p-value is alpha (bisection on the survival function)."""
    lo, hi = 0.0, 10.0 * df + 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi_square_sf(mid, df) > alpha else (lo, mid)
    return (lo + hi) / 2


def chi_square_power(true_probs: Sequence[float], probs: Sequence[float], n: int, alpha: float) -> float:
    """Chance that chi_square_test of n draws from true_probs rejects probs at level alpha
    (noncentral chi-square, summed as a Poisson mixture of central ones)."""
    b, p = _probs(true_probs, "true_probs"), _probs(probs, "probs")
    df = p.numel() - 1
    lam = float(n * ((b - p) ** 2 / p).sum())
    c = critical_value(df, alpha)
    # Poisson(lam / 2) weights, summed over the j where they are not negligible
    half = lam / 2
    spread = 12 * math.sqrt(half + 1)
    power = 0.0
    for j in range(max(0, int(half - spread)), int(half + spread) + 2):
        log_weight = (-half + (j * math.log(half) if half > 0 else (0.0 if j == 0 else -math.inf))
                      - math.lgamma(j + 1))
        power += math.exp(log_weight) * chi_square_sf(c, df + 2 * j)
    return min(1.0, power)
