"""The engine: requests in, tokens out, one scheduler step and one packed forward pass at a time.

Engine owns the pool (PagedKVCache) and the block manager; each step asks the Scheduler what to
compute, copies copy-on-write blocks, runs radarlab.models.paged_runner.paged_step, samples the
requests whose prompt (or recompute) is complete, and finishes those that hit a stop condition.
It plays vLLM's LLMEngine / EngineCore (vllm/v1/engine/); generate and stream are the LLM.generate
and streaming entry points.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Hashable, Iterator, Sequence

import torch

from radarlab.engine.params import SamplingParams
from radarlab.engine.request import Request, RequestStatus
from radarlab.engine.sampler import sample
from radarlab.engine.scheduler import Scheduler, SchedulerOutput
from radarlab.kvcache.block_table import BlockSpaceManager
from radarlab.kvcache.paged_cache import PagedKVCache, num_blocks_for_budget
from radarlab.kvcache.sequence import as_token_ids
from radarlab.models.paged_runner import paged_step
from radarlab.util import require_int


@dataclass
class RequestOutput:
    """A request's progress after a step: new_token_ids are this step's, output_token_ids all so far."""
    request_id: Hashable
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    new_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.RUNNING
    error: str | None = None
    parent_id: Hashable | None = None  # n > 1: samples 1..n-1 have id (parent_id, index)
    index: int = 0
    completions: list[list[int]] = field(default_factory=list)  # generate(): all n samples, by index

    @property
    def finished(self) -> bool:
        return self.status.finished


class Engine:
    def __init__(self, model, num_blocks: int | None, block_size: int = 16, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 512, max_model_len: int | None = None, backend: str = "torch",
                 enable_prefix_caching: bool = True, eos_token_id: int | None = None, watermark: float = 0.0,
                 kv_cache_dtype: str = "auto", kv_cache_bytes: int | None = None) -> None:
        """num_blocks sizes the pool directly; or pass num_blocks=None and kv_cache_bytes, a byte budget
        that num_blocks_for_budget turns into blocks of kv_cache_dtype (FP8: twice 16-bit's blocks)."""
        cfg = model.config
        if max_model_len is None:
            max_model_len = cfg.max_position_embeddings
        require_int("max_model_len (at most the model's context)", max_model_len, 1, cfg.max_position_embeddings)
        param = next(model.parameters())
        if (num_blocks is None) == (kv_cache_bytes is None):
            raise ValueError("give num_blocks or kv_cache_bytes (a byte budget for the pool), not both")
        if num_blocks is None:
            num_blocks = num_blocks_for_budget(kv_cache_bytes, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                               block_size, kv_cache_dtype, param.dtype)
        self.model = model
        self.manager = BlockSpaceManager(num_blocks, block_size, enable_prefix_caching)
        self.cache = PagedKVCache.for_model(cfg, num_blocks, block_size, dtype=param.dtype, device=param.device,
                                            backend=backend, kv_cache_dtype=kv_cache_dtype)
        self.scheduler = Scheduler(self.manager, max_num_seqs, max_num_batched_tokens, max_model_len, watermark)
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self._ids = itertools.count()
        self.num_steps = 0
        self.last_scheduled: SchedulerOutput | None = None  # what the latest step ran (timelines, tests)

    # --- requests -------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: Sequence[int], params: SamplingParams | None = None,
                    request_id: Hashable | None = None) -> Hashable:
        """Queue a request; returns its id. Bad input raises ValueError here; a prompt that cannot
        run (too long for max_model_len or for the pool) is accepted and finishes with an error."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        token_ids = as_token_ids(prompt_token_ids, "prompt_token_ids")  # ValueError if empty
        vocab = self.model.config.vocab_size
        for i, t in enumerate(token_ids):
            if t >= vocab:
                raise ValueError(f"prompt_token_ids[{i}] is {t}, outside the vocabulary (0..{vocab - 1})")
        if request_id is None:
            request_id = next(self._ids)
            while request_id in self.scheduler.requests:
                request_id = next(self._ids)
        self.scheduler.add_request(Request(request_id, token_ids, params, block_size=self.manager.block_size))
        return request_id

    def abort(self, request_id: Hashable) -> bool:
        """Stop a request (all its samples, if n > 1) and free its blocks. False if nothing was running."""
        samples = [request_id] + [(request_id, i) for i in range(1, self._num_samples(request_id))]
        return any([self.scheduler.abort(s) is not None for s in samples])

    def _num_samples(self, request_id: Hashable) -> int:
        request = self.scheduler.requests.get(request_id)
        if request is not None and request.parent_id is None:
            return request.params.n
        # the parent may have finished while its samples run: look for them
        n = 1
        while (request_id, n) in self.scheduler.requests:
            n += 1
        return n

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # --- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run one forward pass, sample. Returns an output for every request that got a
        token or finished this step (errors included)."""
        sched = self.scheduler.schedule()
        self.last_scheduled = sched
        outputs = [self._output(r, []) for r in sched.errored]
        if not sched.requests:
            return outputs
        self.cache.copy_blocks(sched.copy_pairs)
        logits = paged_step(self.model, self.cache, self.manager, sched.requests, sched.num_computed_tokens,
                            sched.num_scheduled_tokens)
        self.scheduler.update(sched)
        self.num_steps += 1
        rows = [b for b, r in enumerate(sched.requests)  # prompt (or recompute) complete: sample
                if r.num_computed_tokens == r.num_tokens]
        if not rows:
            return outputs
        done = [sched.requests[b] for b in rows]
        tokens = sample(logits[rows], [r.params for r in done], [r.generator for r in done])
        forked = []
        for row, request in zip(rows, done):
            if request.params.n > 1 and not request.forked:
                forked += self._fork(request, logits[row])
        for request, token in [*zip(done, tokens), *forked]:
            request.append_token_ids([token])
            status = self._stop_status(request, token)
            if status is not None:
                self.scheduler.finish(request, status)
            outputs.append(self._output(request, [token]))
        return outputs

    def _fork(self, parent: Request, logits: torch.Tensor) -> list[tuple[Request, int]]:
        """Parallel sampling: the prompt is computed; make samples 1..n-1 share its blocks (copy on
        write) and draw their first tokens from the same logits. Returns (sample, token) pairs."""
        parent.forked = True
        p = parent.params
        children = []
        for i in range(1, p.n):
            params = replace(p, n=1, seed=None if p.seed is None else p.seed + i)
            child = Request((parent.request_id, i), parent.prompt_token_ids, params, parent_id=parent.request_id,
                            index=i, block_size=self.manager.block_size)
            child.forked = True
            self.scheduler.add_forked(parent, child)
            children.append(child)
        tokens = sample(logits.expand(len(children), -1), [c.params for c in children],
                        [c.generator for c in children])
        return list(zip(children, tokens))

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        p = request.params
        if token in p.stop_token_ids or (not p.ignore_eos and token == self.eos_token_id):
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= p.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    @staticmethod
    def _output(request: Request, new: list[int]) -> RequestOutput:
        return RequestOutput(request.request_id, request.prompt_token_ids, list(request.output_token_ids), new,
                             request.status, request.error, request.parent_id, request.index)

    # --- whole workloads --------------------------------------------------------------------------
    def _add_all(self, prompts, params) -> list[tuple[Hashable, int]]:
        """Queue every prompt (all validated first); returns (request id, n) per prompt."""
        if not prompts:
            raise ValueError("prompts is empty")
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        for i, p in enumerate(prompts):  # validate all before queueing any
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty")
        return [(self.add_request(p, sp), 1 if sp is None else sp.n) for p, sp in zip(prompts, params)]

    def stream(self, prompts: Sequence[Sequence[int]], params=None) -> Iterator[tuple[Hashable, int]]:
        """Yield (request_id, token) as each token is sampled, until every request has finished.
        Samples 1..n-1 of an n > 1 request yield under the id (request_id, i)."""
        self._add_all(prompts, params)
        while self.has_unfinished_requests():
            for out in self.step():
                for token in out.new_token_ids:
                    yield out.request_id, token

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]], params=None) -> list[RequestOutput]:
        """Run prompts to completion; one final RequestOutput per prompt, in prompt order. Its
        completions hold all n samples (output_token_ids is sample 0)."""
        ids = self._add_all(prompts, params)
        final: dict[Hashable, RequestOutput] = {}
        while self.has_unfinished_requests():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        results = []
        for request_id, n in ids:
            out = final[request_id]
            if out.status is RequestStatus.FINISHED_ERROR:  # never ran, so never forked
                n = 1
            out.completions = [out.output_token_ids] + [final[(request_id, k)].output_token_ids for k in range(1, n)]
            results.append(out)
        return results
