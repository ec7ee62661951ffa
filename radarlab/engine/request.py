"""One request's state as the scheduler sees it (vLLM's Request, vllm/v1/request.py)."""
from __future__ import annotations

import enum
from typing import Hashable

import torch

from radarlab.engine.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; back in the waiting queue, to be recomputed
    FINISHED_STOPPED = "finished_stopped"  # EOS or a stop token
    FINISHED_LENGTH = "finished_length"  # max_tokens or max_model_len reached
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"  # could never run (too long for the model or the pool)

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


class Request:
    """Prompt and output token ids, and how many of them already have K/V in the pool.

    num_computed_tokens counts positions of prompt + output whose K/V is in the cache; after
    preemption it drops to 0 and everything is recomputed. The generator is the request's own,
    seeded from params.seed, so its samples do not depend on which other requests share a batch.
    """

    def __init__(self, request_id: Hashable, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_index: int = 0, parent_id: Hashable | None = None, index: int = 0) -> None:
        self.request_id = request_id
        self.parent_id = parent_id  # parallel sampling: the request this sample was forked from
        self.index = index  # which of the parent's n samples this is (the parent is sample 0)
        self.forked = False  # n > 1: the other n - 1 samples exist (forked after the prompt)
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.arrival_index = arrival_index
        self.error: str | None = None
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def num_seats(self) -> int:
        """Sequence slots (max_num_seqs) the request takes: n until its samples are forked, then 1 each."""
        return 1 if self.forked else self.params.n

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, prompt={len(self.prompt_token_ids)}, "
                f"output={len(self.output_token_ids)}, computed={self.num_computed_tokens})")
