"""The engine: requests in, tokens out, one scheduler step and one packed forward pass at a time.

Engine owns the pool (PagedKVCache) and the block manager; each step asks the Scheduler what to
compute, copies copy-on-write blocks, runs radarlab.models.paged_runner.paged_step, samples the
requests whose prompt (or recompute) is complete, and finishes those that hit a stop condition.
It plays vLLM's LLMEngine / EngineCore (vllm/v1/engine/); generate and stream are the LLM.generate
and streaming entry points.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Hashable, Iterator, Sequence

import torch

from radarlab.engine.params import SamplingParams
from radarlab.engine.request import Request, RequestStatus
from radarlab.engine.sampler import sample
from radarlab.engine.scheduler import Scheduler
from radarlab.kvcache.block_table import BlockSpaceManager, _as_token_ids
from radarlab.kvcache.paged import PagedKVCache
from radarlab.models.paged_runner import paged_step


@dataclass
class RequestOutput:
    """A request's progress after a step: new_token_ids are this step's, output_token_ids all so far."""
    request_id: Hashable
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    new_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.RUNNING
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.status.finished


class Engine:
    def __init__(self, model, num_blocks: int, block_size: int = 16, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, max_model_len: int | None = None, backend: str = "torch",
                 enable_prefix_caching: bool = True, eos_token_id: int | None = None) -> None:
        cfg = model.config
        if max_model_len is None:
            max_model_len = cfg.max_position_embeddings
        if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or not \
                0 < max_model_len <= cfg.max_position_embeddings:
            raise ValueError(f"max_model_len must be in 1..{cfg.max_position_embeddings} (the model's context), "
                             f"got {max_model_len!r}")
        param = next(model.parameters())
        self.model = model
        self.manager = BlockSpaceManager(num_blocks, block_size, enable_prefix_caching)
        self.cache = PagedKVCache.for_model(cfg, num_blocks, block_size, dtype=param.dtype, device=param.device,
                                            backend=backend)
        self.scheduler = Scheduler(self.manager, max_num_seqs, max_num_batched_tokens, max_model_len)
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self._ids = itertools.count()
        self.num_steps = 0

    # --- requests -------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
                    request_id: Hashable | None = None) -> Hashable:
        """Queue a request; returns its id. Bad input raises ValueError here; a prompt that cannot
        run (too long for max_model_len or for the pool) is accepted and finishes with an error."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if params.n != 1:
            raise NotImplementedError(f"n={params.n}: parallel sampling is not supported yet; add n requests")
        token_ids = _as_token_ids(prompt_token_ids, "prompt_token_ids")  # ValueError if empty
        vocab = self.model.config.vocab_size
        for i, t in enumerate(token_ids):
            if t >= vocab:
                raise ValueError(f"prompt_token_ids[{i}] is {t}, outside the vocabulary (0..{vocab - 1})")
        if request_id is None:
            request_id = next(self._ids)
            while request_id in self.scheduler.requests:
                request_id = next(self._ids)
        self.scheduler.add_request(Request(request_id, token_ids, params))
        return request_id

    def abort(self, request_id: Hashable) -> bool:
        """Stop a request and free its blocks. False if it was unknown or already finished."""
        return self.scheduler.abort(request_id) is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # --- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, sample. Returns an output for every request that got a
        token or finished this step (errors included)."""
        sched = self.scheduler.schedule()
        outputs = [self._output(r, []) for r in sched.errored]
        if not sched.requests:
            return outputs
        self.cache.copy_blocks(sched.copy_pairs)
        ids = [r.request_id for r in sched.requests]
        logits = paged_step(self.model, self.cache, self.manager, ids, sched.num_computed_tokens,
                            sched.num_scheduled_tokens)
        self.scheduler.update(sched)
        self.num_steps += 1
        rows = [b for b, r in enumerate(sched.requests)  # prompt (or recompute) complete: sample
                if r.num_computed_tokens == self.manager.num_tokens(r.request_id)]
        if not rows:
            return outputs
        done = [sched.requests[b] for b in rows]
        tokens = sample(logits[rows], [r.params for r in done], [r.generator for r in done])
        for request, token in zip(done, tokens):
            request.output_token_ids.append(token)
            status = self._stop_status(request, token)
            if status is not None:
                self.scheduler.finish(request, status)
            outputs.append(self._output(request, [token]))
        return outputs

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        p = request.params
        if token in p.stop_token_ids or (not p.ignore_eos and token == self.eos_token_id):
            return RequestStatus.FINISHED_STOPPED
        if len(request.output_token_ids) >= p.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    @staticmethod
    def _output(request: Request, new: list[int]) -> RequestOutput:
        return RequestOutput(request.request_id, request.prompt_token_ids, list(request.output_token_ids), new,
                             request.status, request.error)

    # --- whole workloads --------------------------------------------------------------------------
    def _add_all(self, prompts, params) -> list[Hashable]:
        if not prompts:
            raise ValueError("prompts is empty")
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        for i, p in enumerate(prompts):  # validate all before queueing any
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
        return [self.add_request(p, sp) for p, sp in zip(prompts, params)]

    def stream(self, prompts: Sequence[Sequence[int]], params=None) -> Iterator[tuple[Hashable, int]]:
        """Yield (request_id, token) as each token is sampled, until every request has finished."""
        self._add_all(prompts, params)
        while self.has_unfinished_requests():
            for out in self.step():
                for token in out.new_token_ids:
                    yield out.request_id, token

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], params=None) -> list[RequestOutput]:
        """Run prompts to completion; one final RequestOutput per prompt, in prompt order."""
        ids = self._add_all(prompts, params)
        final: dict[Hashable, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]
