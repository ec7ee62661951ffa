"""Top-k and top-p filtering: the boundary cases where an off-by-one keeps one token too many."""
from __future__ import annotations

import math

import pytest
import torch

from radarlab.sample import sampler
from radarlab.sample.sampler import apply_top_k_top_p, greedy_tokens, sample
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


@pytest.mark.parametrize("cpp", [True, False], ids=["cpp_argmax", "torch_argmax"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_tokens_are_torchs_argmax_with_or_without_the_operators(dtype, cpp, monkeypatch):
    """The C++ argmax (where the operators build) and torch's fp32 argmax give the same rows: the first
    of equal maxima, the first NaN in a row with one, index 0 in a row of -inf, rows read through a
    row stride (a slice of wider logits), vocabularies that are and are not whole vectors."""
    from radarlab.cpu_ops import cpu_ops_available

    if cpp and not cpu_ops_available(warn=False):
        pytest.skip("radarlab's C++ operators do not build here")
    if not cpp:
        monkeypatch.setattr(sampler, "cpu_ops_available", lambda *a, **k: False)
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(9, 1000, generator=g).to(dtype)
    logits = wide[:, :997]  # a row stride of 1000, a vocabulary of 997 (a vector tail)
    logits[0] = 0.0  # all equal: index 0
    logits[1] = float("-inf")
    logits[2, [5, 700, 996]] = 9.0  # ties: the first
    logits[3, [40, 10]] = float("nan")  # the first NaN, ahead of any value
    logits[4, 996] = float("nan")  # a NaN in the tail
    logits[5, 996] = 50.0  # the largest in the tail
    logits[6] = torch.randint(0, 3, (997,), generator=g).to(dtype)  # many ties
    want = [0, 0, 5, 10, 996, 996]
    got = greedy_tokens(logits)
    assert got[:6] == want
    assert got == logits.float().argmax(-1).tolist()
    short = torch.tensor([[1.0, 3.0, 3.0]], dtype=dtype)  # shorter than a vector
    assert greedy_tokens(short) == [1]
