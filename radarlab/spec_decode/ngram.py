"""N-gram drafts (prompt lookup): guess that the text continues the way it did the last time its
current ending appeared. Costs no model call, so it pays on copy-heavy output (code edits, quotes).

Same names and matching rule as vLLM's ngram method (vllm/v1/spec_decode/ngram_proposer.py), so
the drafts are the same for the same tokens:

- the n-gram is the sequence's last n tokens, for the largest n in
  [prompt_lookup_min, prompt_lookup_max] that occurs earlier in the sequence;
- among its earlier occurrences the first (leftmost) one is used;
- the draft is the up to num_speculative_tokens tokens that followed it, fewer if the sequence
  ends sooner, and never reaching past max_model_len;
- no match of at least prompt_lookup_min tokens means no draft.

vLLM finds the match with a KMP scan of the reversed sequence; we search n from the largest down,
which gives the same answer.
"""
from __future__ import annotations

from typing import Sequence

from radarlab.spec_decode.proposer import Proposal
from radarlab.util import require_int


def ngram_draft(token_ids: Sequence[int], prompt_lookup_min: int, prompt_lookup_max: int, k: int,
                max_model_len: int | None = None) -> list[int]:
    """Up to k draft tokens for a sequence ending with token_ids[-1] (see the module docstring)."""
    tokens = list(token_ids)
    total = len(tokens)
    if max_model_len is not None:
        k = min(k, max_model_len - total)
    if k <= 0 or total < prompt_lookup_min:
        return []
    for n in range(min(prompt_lookup_max, total - 1), prompt_lookup_min - 1, -1):
        suffix = tokens[total - n:]
        # an occurrence starting at s must end before the last token, so something follows it
        for s in range(0, total - n):
            if tokens[s:s + n] == suffix:
                return tokens[s + n:s + n + k]
    return []


class NgramProposer:
    """Prompt-lookup drafts for any request, with vLLM's speculative_config names."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int | None = None,
                 prompt_lookup_max: int | None = None, max_model_len: int | None = None) -> None:
        # vLLM's defaults: neither given means 5 and 5; one given sets the other
        if prompt_lookup_min is None and prompt_lookup_max is None:
            prompt_lookup_min = prompt_lookup_max = 5
        prompt_lookup_min = prompt_lookup_max if prompt_lookup_min is None else prompt_lookup_min
        prompt_lookup_max = prompt_lookup_min if prompt_lookup_max is None else prompt_lookup_max
        self.num_speculative_tokens = require_int("num_speculative_tokens", num_speculative_tokens, 0)
        self.prompt_lookup_min = require_int("prompt_lookup_min", prompt_lookup_min)
        self.prompt_lookup_max = require_int("prompt_lookup_max", prompt_lookup_max)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min={prompt_lookup_min} must be <= "
                             f"prompt_lookup_max={prompt_lookup_max}")
        self.max_model_len = None if max_model_len is None else require_int("max_model_len", max_model_len)

    def propose(self, requests, num_tokens: Sequence[int]) -> list:
        """One Proposal per request (radarlab.spec_decode.proposer): up to num_tokens[i] drafts, no
        probabilities."""
        return [Proposal(ngram_draft(r.all_token_ids, self.prompt_lookup_min, self.prompt_lookup_max, k,
                                     self.max_model_len))
                for r, k in zip(requests, num_tokens)]

    def free(self, request_id) -> None:
        """Nothing to release: the proposer keeps no per-request state."""
