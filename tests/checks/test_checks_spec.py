"""The checkers of notebook 08: radarlab's references pass, a stub and plausible wrong answers fail."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from radarlab.checks import (
    check_expected_tokens_per_step,
    check_ngram_draft,
    check_rejection_sample,
    check_verify_stochastic,
)
from radarlab.sample.rejection_sampler import rejection_sample, verify_stochastic
from radarlab.spec_decode.ngram import ngram_draft
from radarlab.spec_decode.theory import expected_tokens_per_step

# --- expected_tokens_per_step ----------------------------------------------------------------------

def _k_terms(a, k):  # one term short: a^0 .. a^(k - 1), forgetting the step that accepts all k drafts
    return sum(a ** i for i in range(k))


def _closed_form_unguarded(a, k):  # the geometric sum's closed form divides by zero at a = 1
    return (1 - a ** (k + 1)) / (1 - a)


@pytest.mark.parametrize("fn, words", [
    (expected_tokens_per_step, None),
    (lambda a, k: expected_tokens_per_step(a, k) - 1, "target's own token"),  # counts the drafts only
    (lambda a, k: 1 + a * k, "a^i"),  # judges each draft alone
    (_k_terms, "for a=0.5, k=1 it returned 1, expected 1.5 (the sum runs to a^k"),
    (_closed_form_unguarded, "for a=1.0, k=5 it raised ZeroDivisionError"),
])
def test_expected_tokens_checker(verdict, fn, words):
    verdict(check_expected_tokens_per_step, fn, words)


# --- verify_stochastic -----------------------------------------------------------------------------

def _one_hot(x, vocab):
    return torch.zeros(vocab, dtype=torch.float64).scatter_(0, torch.tensor([x]), 1.0)


def resamples_from_p(p, drafts, q, gen):
    """Wrong: on rejection draws from p itself rather than the residual max(0, p - q)."""
    out = []
    for i, x in enumerate(drafts):
        qi = _one_hot(x, p.shape[1]) if q is None else q[i]
        if torch.rand((), generator=gen) * qi[x] < p[i, x]:
            out.append(x)
            continue
        return out + [int(torch.multinomial(p[i], 1, generator=gen))]
    return out + [int(torch.multinomial(p[-1], 1, generator=gen))]


def accepts_when_p_at_least_q(p, drafts, q, gen):
    """Wrong: accepts exactly the drafts with p(x) >= q(x), with no random draw."""
    out = []
    for i, x in enumerate(drafts):
        qi = _one_hot(x, p.shape[1]) if q is None else q[i]
        if p[i, x] >= qi[x]:
            out.append(x)
            continue
        residual = (p[i] - qi).clamp_min(0)
        return out + [int(torch.multinomial(residual / residual.sum(), 1, generator=gen))]
    return out + [int(torch.multinomial(p[-1], 1, generator=gen))]


def row_zero_everywhere(p, drafts, q, gen):
    """Wrong: judges every draft with row 0 of p and q (and draws the bonus from row 0 too)."""
    k = len(drafts)
    return verify_stochastic(p[:1].expand(k + 1, -1), drafts, None if q is None else q[:1].expand(k, -1), gen)


def bonus_from_the_last_draft_row(p, drafts, q, gen):
    """Wrong: draws the bonus token from p[k - 1], the last draft's row, instead of p[k]."""
    rows = p.clone()
    if len(drafts):
        rows[-1] = p[-2]
    return verify_stochastic(rows, drafts, q, gen)


def forgets_the_bonus(p, drafts, q, gen):
    """Wrong: emits nothing after the last accepted draft."""
    out = verify_stochastic(p, drafts, q, gen)
    return out[:len(drafts)] if len(out) == len(drafts) + 1 else out


@pytest.mark.parametrize("fn, words", [
    (verify_stochastic, None),
    (resamples_from_p, "max(0, p - q)"),
    (accepts_when_p_at_least_q, "chi-square p-value"),
    (forgets_the_bonus, "bonus token"),
    (row_zero_everywhere, "position 1 is judged with row 1 of p and of q, not row 0"),
    (bonus_from_the_last_draft_row, "the bonus is drawn from the last row of p, row k = 2"),
])
def test_verify_stochastic_checker(verdict, fn, words):
    out = verdict(check_verify_stochastic, fn, words)
    if fn is resamples_from_p:
        assert "chi-square p-value" in out


# --- ngram_draft -----------------------------------------------------------------------------------

def last_occurrence(tokens, lo, hi, k):
    """Wrong: the most recent earlier occurrence instead of the first."""
    total = len(tokens)
    for n in range(min(hi, total - 1), lo - 1, -1):
        suffix = tokens[total - n:]
        for s in range(total - n - 1, -1, -1):
            if tokens[s:s + n] == suffix:
                return tokens[s + n:s + n + k]
    return []


def shortest_first(tokens, lo, hi, k):
    """Wrong: tries the shortest n-gram first."""
    for n in range(lo, hi + 1):
        draft = ngram_draft(tokens, n, n, k)
        if draft:
            return draft
    return []


def _lookup(tokens, lo, hi, k, last_start):
    """The prompt-lookup search, trying start positions 0 .. last_start(len(tokens), n)."""
    total = len(tokens)
    for n in range(min(hi, total - 1), lo - 1, -1):
        suffix = tokens[total - n:]
        for s in range(last_start(total, n) + 1):
            if tokens[s:s + n] == suffix:
                return tokens[s + n:s + n + k]
    return []


def no_overlap(tokens, lo, hi, k):
    """Wrong: an earlier occurrence must end before the suffix starts."""
    return _lookup(tokens, lo, hi, k, lambda total, n: total - 2 * n)


def matches_the_suffix_itself(tokens, lo, hi, k):
    """Wrong: the search reaches the suffix itself, which matches with nothing after it."""
    return _lookup(tokens, lo, hi, k, lambda total, n: total - n)


def ignores_k(tokens, lo, hi, k):
    """Wrong: everything that followed the match, not at most k tokens."""
    return ngram_draft(tokens, lo, hi, len(tokens))


def ignores_min(tokens, lo, hi, k):
    """Wrong: falls back to n-grams shorter than prompt_lookup_min."""
    return ngram_draft(tokens, 1, hi, k)


@pytest.mark.parametrize("fn, words", [
    (ngram_draft, None),
    (last_occurrence, "first one is used"),
    (shortest_first, "longest match wins"),
    (no_overlap, "overlaps the suffix at 2-3: it still counts, and token 3 follows it) it returned [], "
                 "expected [7]"),
    (matches_the_suffix_itself, "(the 2-gram [1, 2] occurred at the start) it returned [], expected [3, 4]"),
    (ignores_k, "k=2 (the 2-gram [1, 2] occurred at the start) it returned [3, 4, 1, 2], expected [3, 4]"),
    (ignores_min, "min=2, max=3, k=4 it returned [1, 1, 0, 0], expected []"),
])
def test_ngram_checker(verdict, fn, words):
    verdict(check_ngram_draft, fn, words)


# --- rejection_sample: the engine's batched sampler, vLLM's interface -------------------------------

@dataclass
class Req:
    """One request of a batch, as a per-request rule sees it: its drafts, its rows of p and q, its bonus
    token, whether it is greedy and its generator; `all_p` is the whole target_probs."""
    drafts: list
    p: torch.Tensor
    q: torch.Tensor | None
    bonus: int
    greedy: bool
    gen: torch.Generator | None
    all_p: torch.Tensor


def _batched(rule):
    """A batched sampler (vLLM's interface) from a per-request rule(Req) -> tokens."""
    def sample(draft_token_ids, cu, draft_probs, target_probs, bonus_token_ids, is_greedy, generators):
        ends = [int(c) for c in cu]
        starts = [0] + ends[:-1]
        out = torch.full((len(ends), max(e - s for s, e in zip(starts, ends)) + 1), -1, dtype=torch.long)
        for b, (lo, hi) in enumerate(zip(starts, ends)):
            req = Req(draft_token_ids[lo:hi].tolist(), target_probs[lo:hi],
                      None if draft_probs is None else draft_probs[lo:hi], int(bonus_token_ids[b, 0]),
                      is_greedy[b], generators[b], target_probs)
            tokens = rule(req)
            out[b, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        return out
    return sample


def _judge(r: Req, p=None, gen="own", resample_from_p=False):
    """(tokens, rejected) for the drafts of r, greedy or stochastic, with p (default r.p) as the target."""
    p = r.p if p is None else p
    out = []
    for i, x in enumerate(r.drafts):
        if r.greedy:
            out.append(int(p[i].argmax()))
            if out[-1] != x:
                return out, True
            continue
        qi = r.q[i] if r.q is not None else torch.zeros(p.shape[1], dtype=p.dtype).scatter_(
            0, torch.tensor([x]), 1.0)
        g = r.gen if gen == "own" else None
        if qi[x] > 0 and torch.rand((), generator=g) * qi[x] < p[i, x]:
            out.append(x)
            continue
        dist = p[i] if resample_from_p else (p[i] - qi).clamp_min(0)
        return out + [int(torch.multinomial(dist / dist.sum(), 1, generator=g))], True
    return out, False


def _with_bonus(tokens_rejected, bonus):
    tokens, rejected = tokens_rejected
    return tokens if rejected else tokens + [bonus]


@_batched
def _rows_of_request_0(r):  # every request reads the first rows of target_probs: cu_num_draft_tokens ignored
    return _with_bonus(_judge(r, p=r.all_p[:len(r.drafts)]), r.bonus)


@_batched
def _row_0_for_every_position(r):  # judges every draft of a request with its first row of p and q
    k = len(r.drafts)
    first = Req(r.drafts, r.p[:1].expand(k, -1), None if r.q is None else r.q[:1].expand(k, -1), r.bonus,
                r.greedy, r.gen, r.all_p)
    return _with_bonus(_judge(first), r.bonus)


@_batched
def _bonus_from_the_last_draft_row(r):
    return _with_bonus(_judge(r), int(r.p[-1].argmax()) if r.drafts else r.bonus)


@_batched
def _no_correction(r):  # at a rejection, drops the target's own token
    tokens, rejected = _judge(r)
    return tokens[:-1] if rejected else tokens + [r.bonus]


@_batched
def _resamples_from_p(r):
    return _with_bonus(_judge(r, resample_from_p=True), r.bonus)


@_batched
def _global_random_numbers(r):  # ignores the request's generator
    return _with_bonus(_judge(r, gen=None), r.bonus)


def _lists_not_a_tensor(*args):
    return rejection_sample(*args).tolist()


@pytest.mark.parametrize("fn, words", [
    (rejection_sample, None),
    (_batched(lambda r: _with_bonus(_judge(r), r.bonus)), None),  # the rule written out again passes too
    (_rows_of_request_0, "request 2's rows are target_probs[cu_num_draft_tokens[1]:cu_num_draft_tokens[2]]"),
    (_row_0_for_every_position, "request 0 got [1, 1, -1, -1], expected [1, 2, -1, -1] (draft i is judged "
                                "with the request's row i"),
    (_bonus_from_the_last_draft_row, "emits bonus_token_ids[b], for which target_probs has no row"),
    (_no_correction, "at the first mismatch emit the target's own token"),
    (_resamples_from_p, "on rejection, draw from max(0, p - q) renormalised"),
    (_global_random_numbers, "draw every random number from generators[b]"),
    (_lists_not_a_tensor, "expected a tensor of shape [4, 4]"),
])
def test_rejection_sample_checker(verdict, fn, words):
    verdict(check_rejection_sample, fn, words)
