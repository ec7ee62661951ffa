"""The checkers of notebook 08: radarlab's references pass, a stub and plausible wrong answers fail."""
from __future__ import annotations

import torch

from radarlab.checks import check_expected_tokens_per_step, check_ngram_draft, check_verify_stochastic
from radarlab.sample.rejection_sampler import verify_stochastic
from radarlab.spec_decode.ngram import ngram_draft
from radarlab.spec_decode.theory import expected_tokens_per_step


def _stub(*args):
    raise NotImplementedError()


# --- expected_tokens_per_step ----------------------------------------------------------------------

def test_expected_tokens_checker_accepts_the_reference_and_rejects_mistakes(capsys):
    assert check_expected_tokens_per_step(expected_tokens_per_step)
    assert capsys.readouterr().out.startswith("PASS")
    assert not check_expected_tokens_per_step(_stub)
    assert "not written yet" in capsys.readouterr().out
    assert not check_expected_tokens_per_step(lambda a, k: expected_tokens_per_step(a, k) - 1)  # drafts only
    assert "target's own token" in capsys.readouterr().out
    assert not check_expected_tokens_per_step(lambda a, k: 1 + a * k)  # each draft judged alone
    assert "a^i" in capsys.readouterr().out


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


def forgets_the_bonus(p, drafts, q, gen):
    """Wrong: emits nothing after the last accepted draft."""
    out = verify_stochastic(p, drafts, q, gen)
    return out[:len(drafts)] if len(out) == len(drafts) + 1 else out


def test_verify_stochastic_checker_accepts_the_reference_and_rejects_mistakes(capsys):
    assert check_verify_stochastic(verify_stochastic)
    assert capsys.readouterr().out.startswith("PASS")
    assert not check_verify_stochastic(_stub)
    assert "not written yet" in capsys.readouterr().out
    assert not check_verify_stochastic(resamples_from_p)
    out = capsys.readouterr().out
    assert "chi-square p-value" in out and "max(0, p - q)" in out
    assert not check_verify_stochastic(accepts_when_p_at_least_q)
    assert "chi-square p-value" in capsys.readouterr().out
    assert not check_verify_stochastic(forgets_the_bonus)
    assert "bonus token" in capsys.readouterr().out


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


def test_ngram_checker_accepts_the_reference_and_rejects_mistakes(capsys):
    assert check_ngram_draft(ngram_draft)
    assert capsys.readouterr().out.startswith("PASS")
    assert not check_ngram_draft(_stub)
    assert "not written yet" in capsys.readouterr().out
    assert not check_ngram_draft(last_occurrence)
    assert "first one is used" in capsys.readouterr().out
    assert not check_ngram_draft(shortest_first)
    assert "longest match wins" in capsys.readouterr().out
