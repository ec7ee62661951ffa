"""What speculation can gain, from the acceptance rate alone (Leviathan et al. 2023, section 3).

If each draft token is accepted with probability a, independently, a verify step with k drafts
emits 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a) tokens on average (the accepted drafts plus
the target's own token). The step costs one target forward plus k draft forwards; with c the cost
of a draft forward relative to the target's, the speedup over plain decoding is

    expected_tokens(a, k) / (k c + 1).

This ignores that a verify forward over k + 1 tokens costs more than a decode of one: true while
decoding is memory-bound (a small batch), false once the batch makes it compute-bound.
"""
from __future__ import annotations

from radarlab.util import require_int, require_number


def _rate(a) -> float:
    a = require_number("acceptance rate a", a)
    if not 0 <= a <= 1:
        raise ValueError(f"acceptance rate a must be in [0, 1], got {a!r}")
    return a


def expected_tokens_per_step(a: float, k: int) -> float:
    """Mean tokens a verify step with k drafts emits, each accepted with probability a."""
    a, k = _rate(a), require_int("k", k, 0)
    if a == 1:
        return float(k + 1)
    return (1 - a ** (k + 1)) / (1 - a)


def speedup(a: float, k: int, c: float) -> float:
    """Expected speedup over plain decoding for draft-cost ratio c (draft forward / target forward)."""
    c = require_number("draft cost ratio c", c, 0.0)
    return expected_tokens_per_step(a, k) / (k * c + 1)


def best_k(a: float, c: float, k_max: int = 16) -> int:
    """The k in 0..k_max with the largest speedup (the smallest such k on ties; 0 means do not speculate)."""
    k_max = require_int("k_max", k_max, 0)
    return max(range(k_max + 1), key=lambda k: (speedup(a, k, c), -k))
