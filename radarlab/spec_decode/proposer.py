"""What a proposer is: anything that guesses the next tokens of running requests.

The engine calls a proposer once per step, before scheduling, for the requests that are decoding
(every token but the last has K/V in the target's cache):

    proposals = proposer.propose(requests, num_tokens)   # one Proposal per request
    proposer.free(request_id)                            # the request finished or was aborted

- `requests` are the engine's Request objects. A proposer reads `request_id`, `all_token_ids`
  (prompt + outputs so far, with no drafts in it) and `params` (SamplingParams); it must not change
  them.
- `num_tokens[i]` is the most drafts request i may get (at least 1): the configured
  num_speculative_tokens, cut so that drafts plus the target's own token stay within max_tokens and
  max_model_len. A proposal may be shorter, or empty (no guess: the request decodes plainly).
- `Proposal.draft_probs` is None for a proposer that only has tokens (n-gram: verification treats q
  as one-hot), or q [len(draft_token_ids), vocab]: the distribution each draft was sampled from,
  computed with radarlab.sample.sampler.probabilities and the request's params, so that top-k/top-p
  truncate q as they truncate the target's p. Greedy requests may leave it None.
- A proposer with state per request (a draft model's KV cache) keeps it between calls and checks
  it against `all_token_ids`, which may have lost tokens (a preemption, rejected drafts) or gained
  several (accepted drafts); `free` releases it.

- A proposer that reads the target's features (EAGLE) also has

      proposer.observe(request, start, features)

  which the engine calls after every forward pass, for every scheduled request, with the features
  (paged_step's return_features) of the positions it computed: start .. start + len(features) - 1.
  Positions of drafts that verification then rejects are included; the proposer keeps only those
  below the request's num_tokens - 1 when it next proposes. Without observe, paged_step computes
  no features.

Implementations: radarlab.spec_decode.ngram.NgramProposer,
radarlab.spec_decode.draft_model.DraftModelProposer, radarlab.spec_decode.eagle.EagleProposer, and
radarlab.spec_decode.ngram_eagle.NgramEagleProposer (n-gram first, then the EAGLE head).
A trained draft plugs in as a DraftModelProposer: pass it as
`Engine(..., speculative_config={"method": "draft_model", "num_speculative_tokens": k, "model": draft})`,
where draft is a radarlab Llama (or anything with its forward signature and a .config with
vocab_size, num_layers, num_kv_heads, head_dim) or the path of a Llama checkpoint with the target's
vocabulary. The trained EAGLE-style head is {"method": "eagle", ..., "model": head_dir}.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Proposal:
    """Draft tokens for one request, and the distributions they were drawn from (None: one-hot)."""
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.draft_token_ids = [int(t) for t in self.draft_token_ids]
        if self.draft_probs is not None and self.draft_probs.shape[0] != len(self.draft_token_ids):
            raise ValueError(f"draft_probs has {self.draft_probs.shape[0]} rows for "
                             f"{len(self.draft_token_ids)} draft tokens")
