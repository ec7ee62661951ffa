"""Top-k and top-p filtering: the boundary cases where an off-by-one keeps one token too many."""
from __future__ import annotations

import math

import pytest
import torch

from radarlab.sample.sampler import apply_top_k_top_p


def kept(logits, top_k=0, top_p=1.0) -> list[int]:
    return torch.isfinite(apply_top_k_top_p(torch.tensor(logits), top_k, top_p)).nonzero().flatten().tolist()


def test_top_p_at_the_exact_boundary_keeps_the_smallest_set_that_reaches_it():
    # four equal tokens: the first two hold exactly 0.5, so top_p 0.5 keeps two (vLLM's rule: drop a token
    # when the mass below it, sorted ascending, is <= 1 - top_p); keeping a third is the `>` for `>=` slip
    assert kept([0.0, 0.0, 0.0, 0.0], top_p=0.5) == [0, 1]
    assert kept([0.0, 0.0, 0.0, 0.0], top_p=0.5001) == [0, 1, 2]
    assert kept([0.0, 0.0, 0.0, 0.0], top_p=0.25) == [0]


def test_top_p_follows_the_probabilities_not_the_positions():
    logits = [math.log(0.1), math.log(0.6), math.log(0.3)]  # sorted: 0.6, 0.3, 0.1
    assert kept(logits, top_p=0.55) == [1]
    assert kept(logits, top_p=0.65) == [1, 2]
    assert kept(logits, top_p=0.95) == [0, 1, 2]


def test_the_most_likely_token_always_survives():
    assert kept([5.0, 0.0, 0.0], top_p=1e-6) == [0]


def test_top_k_keeps_k_and_ties_at_the_kth_value():
    assert kept([3.0, 1.0, 2.0, 0.0], top_k=2) == [0, 2]
    assert kept([3.0, 1.0, 1.0, 0.0], top_k=2) == [0, 1, 2]  # the k-th value is shared: both stay
    assert kept([3.0, 1.0, 2.0, 0.0], top_k=2, top_p=0.5) == [0]


@pytest.mark.parametrize("top_k", [0, 4, 10])
def test_no_filter_keeps_everything(top_k):
    assert kept([1.0, 2.0, 3.0, 4.0], top_k=top_k) == [0, 1, 2, 3]
