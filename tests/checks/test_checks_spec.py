"""The checkers of notebook 08: radarlab's references pass, a stub and plausible wrong answers fail."""
from __future__ import annotations

import pytest
import torch

from radarlab.checks import check_expected_tokens_per_step, check_ngram_draft, check_verify_stochastic
from radarlab.sample.rejection_sampler import verify_stochastic
from radarlab.spec_decode.ngram import ngram_draft
from radarlab.spec_decode.theory import expected_tokens_per_step

# --- expected_tokens_per_step ----------------------------------------------------------------------

@pytest.mark.parametrize("fn, words", [
    (expected_tokens_per_step, None),
    (lambda a, k: expected_tokens_per_step(a, k) - 1, "target's own token"),  # counts the drafts only
    (lambda a, k: 1 + a * k, "a^i"),  # judges each draft alone
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


@pytest.mark.parametrize("fn, words", [
    (ngram_draft, None),
    (last_occurrence, "first one is used"),
    (shortest_first, "longest match wins"),
])
def test_ngram_checker(verdict, fn, words):
    verdict(check_ngram_draft, fn, words)
