"""vLLM's comparison rule on synthetic cases: where it must pass, where it must fail, and bad input."""
from __future__ import annotations

import pytest
import torch

from radarlab.validate.compare import compare_greedy, max_logprob_diff, topk_logprobs


def lp(*tokens):
    """A logprob dict ranking the given tokens first to last."""
    return {t: -0.1 - i for i, t in enumerate(tokens)}


def test_identical_sequences_pass():
    toks = [5, 6, 7]
    r = compare_greedy(toks, [lp(5), lp(6), lp(7)], toks, [lp(5), lp(6), lp(7)], k=5)
    assert r.passed and r.identical
    assert (r.matched, r.diverged_at, r.len_a, r.len_b) == (3, None, 3, 3)


def test_identical_needs_no_logprobs_lookup():
    """With no divergence the logprobs are never consulted, as in vLLM."""
    assert compare_greedy([1, 2], [], [1, 2], [], k=5).passed


def test_near_tie_divergence_passes_and_later_tokens_are_ignored():
    a = [5, 6, 7, 100, 101]
    b = [5, 6, 8, 200, 201]  # everything after position 2 differs and must not matter
    la = [lp(5), lp(6), lp(7, 8, 9), lp(100), lp(101)]
    lb = [lp(5), lp(6), lp(8, 7, 9), lp(200), lp(201)]
    r = compare_greedy(a, la, b, lb, k=2)
    assert r.passed and not r.identical
    assert (r.matched, r.diverged_at) == (2, 2)
    assert "near-tie" in r.reason


def test_divergence_outside_top_k_fails():
    a, b = [5, 7], [5, 8]
    la = [lp(5), lp(7, 1, 2, 3, 4, 8)]  # 8 is a's 6th choice: outside its top-5
    lb = [lp(5), lp(8, 7)]
    r = compare_greedy(a, la, b, lb, k=5, names=("ours", "vLLM"))
    assert not r.passed
    assert (r.matched, r.diverged_at) == (1, 1)
    assert "vLLM's token 8 is not in ours's top-5" in r.reason
    # the same data with a wider window passes: the rule depends on k
    assert compare_greedy(a, la, b, lb, k=6).passed


def test_one_sided_membership_fails():
    """Each side's token must be in the other's list; one direction is not enough."""
    a, b = [3], [4]
    r = compare_greedy(a, [lp(3, 4)], b, [lp(4, 9)], k=2)
    assert not r.passed and "ours" not in r.reason and "a's token 3 is not in b's" in r.reason


def test_k_none_uses_every_entry_and_k_truncates_by_logprob():
    a, b = [3], [4]
    la = [{9: -5.0, 4: -3.0, 3: -0.1}]  # unsorted on purpose: 4 is second by logprob
    lb = [{4: -0.1, 3: -0.2}]
    assert compare_greedy(a, la, b, lb, k=None).passed
    assert compare_greedy(a, la, b, lb, k=2).passed
    assert not compare_greedy(a, la, b, lb, k=1).passed


def test_prefix_of_other_passes_like_vllm():
    """One side stopped early (EOS): as in vLLM, the shared tokens decide."""
    r = compare_greedy([1, 2], [lp(1), lp(2)], [1, 2, 3], [lp(1), lp(2), lp(3)], k=5)
    assert r.passed and not r.identical and r.diverged_at is None and r.matched == 2


def test_string_keys_from_json_work():
    r = compare_greedy([3], [{"3": -0.1, "4": -0.2}], [4], [{"4": -0.1, "3": -0.3}], k=2)
    assert r.passed


@pytest.mark.parametrize("kwargs, err", [
    (dict(tokens_a="abc"), TypeError),
    (dict(tokens_a=[1, -2]), ValueError),
    (dict(tokens_a=[1, 2.0]), ValueError),
    (dict(tokens_a=[True]), ValueError),
    (dict(k=0), ValueError),
    (dict(k=2.5), ValueError),
    (dict(logprobs_a=[lp(1)]), ValueError),  # too few positions to reach the divergence
    (dict(logprobs_a=[lp(1), {}]), ValueError),  # empty dict at the divergence
    (dict(logprobs_b="x"), TypeError),
])
def test_bad_inputs_raise(kwargs, err):
    args = dict(tokens_a=[1, 2], logprobs_a=[lp(1), lp(2, 3)], tokens_b=[1, 3], logprobs_b=[lp(1), lp(3, 2)],
                k=5)
    args.update(kwargs)
    with pytest.raises(err):
        compare_greedy(**args)


def test_max_logprob_diff_uses_shared_tokens_only():
    a = [{1: -0.1, 2: -2.0}, {5: -1.0}]
    b = [{1: -0.15, 3: -9.0}, {5: -3.0}]
    assert max_logprob_diff(a, b, 1) == pytest.approx(0.05)
    assert max_logprob_diff(a, b, 2) == pytest.approx(2.0)


class _Toy(torch.nn.Module):
    """A stand-in with our model's calling convention: logits depend on the previous token only,
    so the teacher-forced logprobs are known in closed form."""

    def __init__(self, vocab=7):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0)))
        self.config = type("C", (), {"vocab_size": vocab, "max_position_embeddings": 16, "num_layers": 1,
                                     "num_kv_heads": 1, "head_dim": 2})()

    def forward(self, ids, positions, cache, meta, logits_indices=None):
        out = self.table[ids]
        return out if logits_indices is None else out[logits_indices]


def test_topk_logprobs_positions_and_values():
    m = _Toy()
    prompt, cont = [1, 2], [3, 4, 5]
    got = topk_logprobs(m, prompt, cont, k=3)
    assert len(got) == 3
    for prev, d in zip([2, 3, 4], got):  # position i is predicted from the token before it
        ref = torch.log_softmax(m.table[prev].detach(), -1)
        v, i = ref.topk(3)
        assert list(d) == i.tolist()
        assert list(d.values()) == pytest.approx(v.tolist(), abs=1e-6)
    assert topk_logprobs(m, prompt, [], k=3) == []


@pytest.mark.parametrize("prompt, cont, k", [
    ([], [1], 3),  # empty prompt
    ([1], [2], 0),  # k too small
    ([1], [2], 8),  # k larger than the vocabulary
    ([1], [7], 3),  # token outside the vocabulary
    ([1] * 10, [2] * 8, 3),  # longer than the context
])
def test_topk_logprobs_bad_inputs(prompt, cont, k):
    with pytest.raises(ValueError):
        topk_logprobs(_Toy(), prompt, cont, k)
