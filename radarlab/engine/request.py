"""One request's state as the scheduler sees it (vLLM's Request, vllm/v1/request.py)."""
from __future__ import annotations

import enum
from typing import Hashable

import torch

from radarlab.kvcache.sequence import Sequence
from radarlab.sample.sampling_params import SamplingParams


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


class Request(Sequence):
    """A Sequence (the one store of its token ids and block hashes) plus what scheduling and
    sampling need: how many tokens already have K/V in the pool, status, and its own generator.

    num_computed_tokens counts positions of prompt + output whose K/V is in the cache; after
    preemption it drops to 0 and everything is recomputed. The generator is the request's own,
    seeded from params.seed, so its samples do not depend on which other requests share a batch.
    """

    def __init__(self, request_id: Hashable, prompt_token_ids: list[int], params: SamplingParams,
                 arrival_index: int = 0, parent_id: Hashable | None = None, index: int = 0,
                 block_size: int | None = None) -> None:
        super().__init__(request_id, prompt_token_ids, block_size)
        self.parent_id = parent_id  # parallel sampling: the request this sample was forked from
        self.index = index  # which of the parent's n samples this is (the parent is sample 0)
        self.forked = False  # n > 1: the other n - 1 samples exist (forked after the prompt)
        self.params = params
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.arrival_index = arrival_index
        self.error: str | None = None
        # Speculative decoding: this step's drafts, kept beside the tokens (never in them, so never
        # hashed), and the distributions they were drawn from (None: one-hot, e.g. n-gram).
        self.spec_token_ids: list[int] = []
        self.spec_probs: torch.Tensor | None = None
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed)
        else:
            self.generator.seed()

    @property
    def request_id(self) -> Hashable:
        return self.seq_id

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def num_tokens_with_spec(self) -> int:
        """Tokens plus this step's drafts: what the scheduler brings num_computed_tokens up to."""
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def num_seats(self) -> int:
        """Sequence slots (max_num_seqs) the request takes: n until its samples are forked, then 1 each."""
        return 1 if self.forked else self.params.n

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
                f"output={self.num_output_tokens}, computed={self.num_computed_tokens})")
