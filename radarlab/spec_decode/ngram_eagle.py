"""N-gram drafts where the text repeats, the EAGLE head's everywhere else: radarlab's method
"ngram_eagle". vLLM has no such method; its speculative_config takes one method per engine.

Why both: prompt lookup costs no model call and, when it finds a match, is right more often than
the trained head, but it has a guess only where the text repeats; the head always has one.
draft_eval measures the pair as "ngram+draft" (the n-gram's draft when it has one, else the head's).

Each step the n-gram proposes for every request; the head proposes only for the requests the
n-gram left without a draft. The head still reads the target's features on every step (observe and
free go to it, whoever drafted): EagleProposer keeps every feature it has not consumed, so when it
next drafts for a request it catches up on all the positions it skipped, from the true features.
A run of n-gram steps therefore costs the head nothing until it is needed.

N-gram drafts carry no probabilities (verification treats q as one-hot); the head's keep theirs,
so one batch may hold both kinds, for greedy and sampled requests alike.
"""
from __future__ import annotations

from typing import Hashable, Sequence

import torch

from radarlab.spec_decode.eagle import EagleProposer
from radarlab.spec_decode.ngram import NgramProposer
from radarlab.spec_decode.proposer import Proposal


class NgramEagleProposer:
    """Tries `ngram` first and `eagle` for the requests it has no draft for.
    num_drafts_by_source counts the proposals with drafts each source made."""

    def __init__(self, ngram: NgramProposer, eagle: EagleProposer) -> None:
        if ngram.num_speculative_tokens != eagle.num_speculative_tokens:
            raise ValueError(f"the n-gram proposer drafts {ngram.num_speculative_tokens} tokens, the EAGLE "
                             f"proposer {eagle.num_speculative_tokens}: they must agree")
        self.ngram, self.eagle = ngram, eagle
        self.num_speculative_tokens = ngram.num_speculative_tokens
        self.num_drafts_by_source = {"ngram": 0, "eagle": 0}

    def propose(self, requests: Sequence, num_tokens: Sequence[int]) -> list[Proposal]:
        proposals = self.ngram.propose(requests, num_tokens)
        rest = [i for i, p in enumerate(proposals) if not p.draft_token_ids]
        self.num_drafts_by_source["ngram"] += len(proposals) - len(rest)
        if rest:
            guesses = self.eagle.propose([requests[i] for i in rest], [num_tokens[i] for i in rest])
            for i, proposal in zip(rest, guesses):
                proposals[i] = proposal
                self.num_drafts_by_source["eagle"] += bool(proposal.draft_token_ids)
        return proposals

    def observe(self, request, start: int, features: torch.Tensor) -> None:
        """Every step's features go to the head, whoever drafted (radarlab.spec_decode.proposer)."""
        self.eagle.observe(request, start, features)

    def free(self, request_id: Hashable) -> None:
        self.ngram.free(request_id)
        self.eagle.free(request_id)
