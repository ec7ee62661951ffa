"""How to sample one request's tokens (vLLM's SamplingParams, a subset of its fields)."""
from __future__ import annotations

from dataclasses import dataclass, field

from radarlab.util import require_int


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy. top_k 0 (or -1) and top_p 1.0 mean no truncation.

    seed makes the request's samples reproducible whatever else is in the batch: each request
    draws from its own generator. n > 1 asks for n samples of one prompt (parallel sampling): the
    prompt is computed once and its blocks shared; sample i draws from seed + i.
    """
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    seed: int | None = None
    n: int = 1
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        require_int("max_tokens", self.max_tokens)
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        require_int("top_k (0 or -1 mean all tokens)", self.top_k, -1)
        require_int("n", self.n)
        if self.seed is not None:
            require_int("seed", self.seed, None)
        stops = tuple(self.stop_token_ids)
        for t in stops:
            require_int("stop_token_ids", t, 0)
        object.__setattr__(self, "stop_token_ids", stops)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
