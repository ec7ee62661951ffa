"""Speculative decoding counters, under vLLM's names (vllm/v1/spec_decode/metrics.py).

num_drafts counts verify steps of a request that had drafts, num_draft_tokens the drafts proposed
and verified, num_accepted_tokens those accepted, num_accepted_tokens_per_pos[i] how often draft
i was accepted. vLLM's mean acceptance length counts the bonus token: 1 + accepted / drafts.
tokens_per_forward is the engine's output tokens per target forward pass, over all requests.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingStats:
    num_spec_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)
    num_forwards: int = 0  # target forward passes
    num_output_tokens: int = 0  # tokens they produced (accepted drafts and sampled tokens)

    def __post_init__(self) -> None:
        self.num_accepted_tokens_per_pos = self.num_accepted_tokens_per_pos or [0] * self.num_spec_tokens
        self.num_draft_tokens_per_pos = self.num_draft_tokens_per_pos or [0] * self.num_spec_tokens

    def observe_draft(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        if not 0 <= num_accepted_tokens <= num_draft_tokens <= self.num_spec_tokens:
            raise ValueError(f"{num_accepted_tokens} accepted of {num_draft_tokens} drafts "
                             f"(at most {self.num_spec_tokens})")
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1
        for i in range(num_draft_tokens):
            self.num_draft_tokens_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts (nan before the first draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else float("nan")

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step, the target's own token included: 1 + accepted / drafts."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else float("nan")

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """How often draft position i was accepted, per verify step (vLLM's per-position rate)."""
        return [a / self.num_drafts if self.num_drafts else float("nan")
                for a in self.num_accepted_tokens_per_pos]

    @property
    def tokens_per_forward(self) -> float:
        return self.num_output_tokens / self.num_forwards if self.num_forwards else float("nan")
