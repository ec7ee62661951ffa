"""N-gram (prompt lookup) drafts: vLLM's matching rule on hand-made cases, against a brute-force
reading of the rule on random sequences, and against vLLM's own function."""
from __future__ import annotations

import json
import random
import subprocess

import pytest

from radarlab.spec_decode.ngram import NgramProposer, ngram_draft
from radarlab.validate.vllm import vllm_python


@pytest.mark.parametrize("tokens, lo, hi, k, draft", [
    ([1, 2, 3, 9, 2, 3, 8, 1, 2, 3], 1, 3, 2, [9, 2]),  # the 3-gram 1 2 3 wins over later 2 3
    ([5, 1, 2, 7, 1, 2, 6, 1, 2], 2, 2, 1, [7]),  # two earlier occurrences: the first one
    ([4, 5, 6, 4, 5], 2, 4, 5, [6, 4, 5]),  # fewer than k tokens follow: all of them
    ([4, 5, 6, 4, 5], 3, 4, 5, []),  # no match of prompt_lookup_min tokens
    ([7, 7, 7, 7], 1, 3, 4, [7]),  # the match may overlap the suffix; it ends before the last token
    ([3], 1, 2, 3, []),  # nothing before the last token
])
def test_hand_made_cases(tokens, lo, hi, k, draft):
    assert ngram_draft(tokens, lo, hi, k) == draft


def test_max_model_len_cuts_the_draft():
    tokens = [1, 2, 3, 4, 5, 1, 2]
    assert ngram_draft(tokens, 2, 2, 4) == [3, 4, 5, 1]
    assert ngram_draft(tokens, 2, 2, 4, max_model_len=9) == [3, 4]
    assert ngram_draft(tokens, 2, 2, 4, max_model_len=7) == []


def brute_force(tokens, lo, hi, k):
    """The rule read literally: for every earlier start s, the longest n-gram (<= hi) starting at s
    that equals the suffix; the longest over all s wins, the first s among equals."""
    best_n, best_s = 0, None
    for s in range(len(tokens) - 1):
        n = max((n for n in range(1, hi + 1) if s + n <= len(tokens) - 1
                 and tokens[s:s + n] == tokens[len(tokens) - n:]), default=0)
        if n > best_n:
            best_n, best_s = n, s
    if best_n < lo:
        return []
    return tokens[best_s + best_n:best_s + best_n + k]


def random_cases(n, seed=0):
    rng = random.Random(seed)
    cases = []
    for _ in range(n):
        lo = rng.randint(1, 3)
        cases.append((
            [rng.randrange(rng.choice([2, 3, 5])) for _ in range(rng.randint(1, 40))],
            lo, rng.randint(lo, 5), rng.randint(1, 6)))
    return cases


def test_equals_the_rule_read_literally_on_random_sequences():
    for tokens, lo, hi, k in random_cases(2000):
        assert ngram_draft(tokens, lo, hi, k) == brute_force(tokens, lo, hi, k), (tokens, lo, hi, k)


VLLM_SCRIPT = """
import json, sys
import numpy as np
from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens as find
cases = json.load(sys.stdin)
out = [find.py_func(np.array(t, dtype=np.int32), lo, hi, 10**6, k).tolist() for t, lo, hi, k in cases]
print(json.dumps(out))
"""


@pytest.mark.vllm
def test_equals_vllms_ngram_proposer():
    cases = random_cases(500, seed=1)
    result = subprocess.run([str(vllm_python()), "-c", VLLM_SCRIPT], input=json.dumps(cases), text=True,
                            capture_output=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    theirs = json.loads(result.stdout.strip().splitlines()[-1])
    assert [ngram_draft(*c) for c in cases] == theirs


def test_proposer_settings_follow_vllm():
    p = NgramProposer(3)
    assert (p.prompt_lookup_min, p.prompt_lookup_max) == (5, 5)  # vLLM's defaults
    assert (NgramProposer(3, prompt_lookup_max=4).prompt_lookup_min,
            NgramProposer(3, 2).prompt_lookup_max) == (4, 2)
    with pytest.raises(ValueError, match="prompt_lookup_min=4 must be <= prompt_lookup_max=2"):
        NgramProposer(3, 4, 2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(-1)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 0, 2)
