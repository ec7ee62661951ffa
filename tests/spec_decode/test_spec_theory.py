"""Speculation's expected gain (radarlab.spec_decode.theory) against closed forms and a simulation."""
from __future__ import annotations

import random

import pytest

from radarlab.spec_decode.theory import best_k, expected_tokens_per_step, speedup


def simulate(a, k, n=40000, seed=0):
    """Mean tokens per verify step when each draft is accepted with probability a, in order."""
    rng = random.Random(seed)
    total = 0
    for _ in range(n):
        accepted = 0
        while accepted < k and rng.random() < a:
            accepted += 1
        total += accepted + 1
    return total / n


@pytest.mark.parametrize("a, k", [(0.3, 1), (0.6, 4), (0.9, 5), (0.75, 8)])
def test_expected_tokens_matches_a_simulation(a, k):
    assert expected_tokens_per_step(a, k) == pytest.approx(simulate(a, k), rel=0.02)


def test_edges():
    assert expected_tokens_per_step(0.0, 5) == 1.0  # nothing accepted: plain decoding
    assert expected_tokens_per_step(1.0, 5) == 6.0  # everything accepted (the formula's 0/0)
    assert expected_tokens_per_step(0.999999, 5) == pytest.approx(6.0, rel=1e-5)  # continuous at a = 1
    assert expected_tokens_per_step(0.5, 0) == 1.0
    assert speedup(0.8, 0, 0.3) == 1.0


def test_speedup_and_best_k():
    # Leviathan et al.: speedup = (1 - a^(k+1)) / ((1 - a)(k c + 1))
    assert speedup(0.8, 4, 0.05) == pytest.approx((1 - 0.8 ** 5) / (0.2 * 1.2))
    assert best_k(0.0, 0.1) == 0  # a draft that is never right never pays
    assert best_k(1.0, 0.0) == 16  # a free, perfect draft: as many as allowed
    k = best_k(0.8, 0.05)
    assert speedup(0.8, k, 0.05) >= max(speedup(0.8, j, 0.05) for j in range(17))
    assert 0 < k < 16
    assert best_k(0.8, 0.2) < k  # a costlier draft: fewer drafts


@pytest.mark.parametrize("call, match", [
    (lambda: expected_tokens_per_step(1.5, 3), "acceptance rate a must be in"),
    (lambda: expected_tokens_per_step(0.5, -1), "k must be"),
    (lambda: speedup(0.5, 2, -0.1), "draft cost ratio c"),
    (lambda: best_k(0.5, 0.1, k_max=1.5), "k_max"),
])
def test_bad_input_raises(call, match):
    with pytest.raises(ValueError, match=match):
        call()
