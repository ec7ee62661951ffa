"""Top-k and top-p filtering: the boundary cases where an off-by-one keeps one token too many."""
from __future__ import annotations

import math

import pytest
import torch

from radarlab.sample.sampler import apply_top_k_top_p, sample
from radarlab.sample.sampling_params import SamplingParams


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_rows_pick_the_first_largest_logit_in_any_dtype(dtype):
    """Greedy rows of any logits dtype: ties go to the first index and a one-ulp lead wins (the
    argmax of the values widened to fp32); a sampled row beside them draws a valid token."""
    torch.manual_seed(0)
    logits = torch.randn(4, 300).to(dtype)
    logits[0, [7, 9]] = logits[0].max() + 1  # a tie: the first of the two
    logits[1] = logits[1].clamp(max=3.0)
    logits[1, 11], logits[1, 12] = 5.0, 5.0 + 4 * torch.finfo(dtype).eps  # one ulp apart, in [4, 8)
    params = [SamplingParams(), SamplingParams(), SamplingParams(temperature=1.0, seed=3), SamplingParams()]
    gens = [None, None, torch.Generator().manual_seed(3), None]
    got = sample(logits, params, gens)
    want = logits.float().argmax(-1).tolist()
    assert got[0] == 7 and got[1] == 12 == want[1] and got[3] == want[3]
    assert 0 <= got[2] < 300
