"""The engine: requests in, tokens out, one scheduler step and one packed forward pass at a time.

Engine owns the pool (PagedKVCache) and the block manager; each step asks the Scheduler what to
compute, hands its output to the ModelRunner (radarlab.engine.model_runner: execute_model, one
forward pass), samples the requests whose prompt (or recompute) is complete, and finishes those that
hit a stop condition.
It plays vLLM's LLMEngine / EngineCore (vllm/v1/engine/); generate and stream are the LLM.generate
and streaming entry points.

With speculative_config (radarlab.spec_decode.speculative_config: vLLM's keys), each step first asks the
proposer for drafts for the decoding requests, kept in their spec_token_ids (beside the tokens, as
vLLM v1 does); the step's forward pass then verifies them (logits at the last token and at every
draft: the rows SpecDecodeMetadata locates), radarlab.sample.rejection_sampler decides how many
are accepted, Scheduler.update counts the rejected drafts' positions as not computed (their slots
stay reserved, as in vLLM), and the accepted drafts join the tokens with the target's own token.
spec_stats counts drafts and acceptances.
A proposer with an `observe` method (EAGLE) also gets the target's features of every computed token.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Hashable, Iterator, Sequence

import torch

from radarlab.engine.model_runner import ModelRunner
from radarlab.engine.request import Request, RequestStatus
from radarlab.engine.scheduler import Scheduler, SchedulerOutput
from radarlab.kvcache.block_pool import BlockPool
from radarlab.kvcache.kv_cache_manager import KVCacheManager
from radarlab.kvcache.paged_cache import PagedKVCache, num_blocks_for_budget
from radarlab.kvcache.sequence import as_token_ids
from radarlab.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, rejection_sample
from radarlab.sample.sampler import probabilities, sample
from radarlab.sample.sampling_params import SamplingParams
from radarlab.spec_decode.metrics import SpecDecodingStats
from radarlab.spec_decode.speculative_config import make_proposer
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
                 kv_cache_dtype: str = "auto", kv_cache_bytes: int | None = None,
                 speculative_config: dict | None = None, cpu_ops: bool | None = None,
                 rejection_sampler=rejection_sample, block_pool_cls=BlockPool,
                 scheduler_cls=Scheduler, attn_backend=None, kivi_quantizer=None,
                 enforce_eager: bool = False) -> None:
        """num_blocks sizes the pool directly; or pass num_blocks=None and kv_cache_bytes, a byte budget
        that num_blocks_for_budget turns into blocks of kv_cache_dtype (FP8: twice 16-bit's blocks).
        max_model_len must fit the pool (ValueError naming both); None: the model's context, capped at
        what the pool holds (vLLM refuses a default that does not fit; the course's small pools would
        all be refused).
        speculative_config takes vLLM's keys (radarlab.spec_decode.speculative_config). cpu_ops: whether the
        KV write and decode attention use radarlab's C++ operators on a CPU (PagedKVCache; None: wherever
        they can be built; the model's own are Llama.use_cpu_ops). rejection_sampler verifies a step's
        drafts: radarlab.sample.rejection_sampler.rejection_sample or anything with its signature
        (vLLM's), such as a learner's own; block_pool_cls makes the KV cache manager's BlockPool (a
        learner's own class with BlockPool's methods works too); scheduler_cls makes the Scheduler, from
        the same arguments (notebook 05 runs a learner's schedule()); attn_backend replaces the attention
        backend the cache's configuration picks (notebook 04 runs one with the learner's decode kernel).
        kivi_quantizer (radarlab.quant.kivi.KiviQuantizer): a KIVI cache's key quantizer and
        quantized_length, such as a learner's (notebook 07); None: radarlab's.
        enforce_eager (vLLM's name): False replays each step's captured calls where the configuration
        allows (radarlab.models.replay; self.runner.eager_reason says why not), True always runs the
        model's forward, module by module (the two give the same logits)."""
        cfg = model.config
        if max_model_len is not None:
            require_int("max_model_len (at most the model's context)", max_model_len, 1,
                        cfg.max_position_embeddings)
        param = next(model.parameters())
        if (num_blocks is None) == (kv_cache_bytes is None):
            raise ValueError("give num_blocks or kv_cache_bytes (a byte budget for the pool), not both")
        if num_blocks is None:
            num_blocks = num_blocks_for_budget(kv_cache_bytes, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                               block_size, kv_cache_dtype, param.dtype, max_num_seqs)
        require_int("num_blocks", num_blocks)
        pool_tokens = num_blocks * block_size
        if max_model_len is None:  # the model's context, as far as the pool holds it
            max_model_len = min(cfg.max_position_embeddings, pool_tokens)
        elif max_model_len > pool_tokens:  # vLLM refuses this at startup too: a long request could never run
            raise ValueError(f"max_model_len={max_model_len} does not fit the KV cache: its {num_blocks} "
                             f"blocks of {block_size} hold {pool_tokens} tokens; give more blocks (or "
                             f"kv_cache_bytes) or a smaller max_model_len")
        self.model = model
        self.manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching, block_pool_cls)
        self.cache = PagedKVCache.for_model(cfg, num_blocks, block_size, dtype=param.dtype,
                                            device=param.device, backend=backend,
                                            kv_cache_dtype=kv_cache_dtype, max_num_seqs=max_num_seqs,
                                            cpu_ops=cpu_ops, kivi_quantizer=kivi_quantizer)
        self.scheduler = scheduler_cls(self.manager, max_num_seqs, max_num_batched_tokens, max_model_len,
                                       watermark)
        self.runner = ModelRunner(model, self.cache, attn_backend, enforce_eager)
        self.max_model_len = max_model_len
        self.eos_token_id = eos_token_id
        self._ids = itertools.count()
        self.num_steps = 0
        self.last_scheduled: SchedulerOutput | None = None  # what the latest step ran (timelines, tests)
        self.proposer = None if speculative_config is None else make_proposer(
            speculative_config, model, num_blocks, block_size, max_model_len, backend)
        self.spec_stats = (None if self.proposer is None
                           else SpecDecodingStats(self.proposer.num_speculative_tokens))
        self.rejection_sampler = rejection_sampler

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
        if self.proposer is not None:
            for s in samples:
                self.proposer.free(s)
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
        """Schedule, run one forward pass, sample (or verify drafts). Returns an output for every
        request that got tokens or finished this step (errors included)."""
        self._propose()
        sched = self.scheduler.schedule()
        self.last_scheduled = sched
        if self.proposer is not None:  # a preempted request is recomputed from its first token on return:
            for r in sched.preempted:  # its draft copy goes too, as vLLM frees both together
                self.proposer.free(r.request_id)
        outputs = [self._output(r, []) for r in sched.errored]
        if not sched.requests:
            return outputs
        observe = getattr(self.proposer, "observe", None)  # a proposer that reads the target's features
        out = self.runner.execute_model(sched, return_features=observe is not None)
        if observe is not None:
            starts = itertools.accumulate(sched.num_scheduled_tokens, initial=0)
            for r, done, lo, n in zip(sched.requests, sched.num_computed_tokens, starts,
                                      sched.num_scheduled_tokens):
                observe(r, done, out.features[lo:lo + n])
        self.num_steps += 1
        if self.spec_stats is not None:
            self.spec_stats.num_forwards += 1
        logits, spec = out.logits, out.spec_decode_metadata
        rows = [b for b, (r, done, n) in enumerate(zip(sched.requests, sched.num_computed_tokens,
                                                        sched.num_scheduled_tokens))
                if done + n == r.num_tokens_with_spec]  # prompt (or recompute) complete: sample
        plain = [b for b in rows if not sched.num_spec_tokens[b]]
        emitted = {}  # b -> this step's tokens
        if plain:
            done = [sched.requests[b] for b in plain]
            last = [out.last_row(b) for b in plain]
            picked = logits if last == list(range(logits.shape[0])) else logits[last]  # decode steps: no copy
            tokens = sample(picked, [r.params for r in done], [r.generator for r in done])
            emitted.update((b, [t]) for b, t in zip(plain, tokens))
        num_rejected = [0] * len(sched.requests)
        verifying = [b for b in rows if sched.num_spec_tokens[b]]
        if verifying:
            for b, tokens in zip(verifying, self._verify([sched.requests[b] for b in verifying],
                                                         [logits[spec.rows(b)] for b in verifying])):
                emitted[b] = tokens
                num_rejected[b] = sched.num_spec_tokens[b] - (len(tokens) - 1)
        self.scheduler.update(sched, num_rejected)  # the one place num_computed_tokens moves
        if not rows:
            return outputs
        forked = []
        for b in plain:
            request = sched.requests[b]
            if request.params.n > 1 and not request.forked:
                forked += self._fork(request, logits[out.last_row(b)])
        for b in rows:
            outputs.append(self._commit(sched.requests[b], emitted[b]))
        for child, token in forked:
            outputs.append(self._commit(child, [token]))
        return outputs

    def _propose(self) -> None:
        """Drafts for every decoding request (all tokens but the last computed), into its spec_token_ids,
        beside its tokens. A request gets at most as many as leave room for the target's own token
        within max_tokens and max_model_len."""
        if self.proposer is None:
            return
        ready, limits = [], []
        for r in self.scheduler.running:
            if r.num_computed_tokens == r.num_tokens - 1:
                k = min(self.proposer.num_speculative_tokens, r.params.max_tokens - r.num_output_tokens - 1,
                        self.max_model_len - r.num_tokens - 1)
                if k > 0:
                    ready.append(r)
                    limits.append(k)
        if not ready:
            return
        for request, k, proposal in zip(ready, limits, self.proposer.propose(ready, limits)):
            drafts = proposal.draft_token_ids[:k]
            vocab = self.model.config.vocab_size
            bad = [t for t in drafts if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"the proposer drafted token ids {bad} for request "
                                 f"{request.request_id!r}, outside the target's vocabulary (0..{vocab - 1})")
            if drafts:
                request.spec_token_ids = drafts
                probs = proposal.draft_probs
                request.spec_probs = None if probs is None else probs[:len(drafts)]

    def _verify(self, requests: list[Request], logits: list[torch.Tensor]) -> list[list[int]]:
        """Verify every request's drafts at once, request b against its logits[b] [k+1, V]: p from
        each draft's row under the request's sampling parameters (the q of its drafts was shaped the
        same way), the bonus token sampled from the last row by the ordinary sampler, then one call of
        the rejection sampler. Returns each request's tokens: accepted drafts, then the target's own
        (a correction, or the bonus after k accepted)."""
        drafts = [r.spec_token_ids for r in requests]
        params = [r.params for r in requests]
        generators = [r.generator for r in requests]
        bonus = sample(torch.stack([rows[-1] for rows in logits]), params, generators)
        target = torch.cat([probabilities(rows[:-1], p) for rows, p in zip(logits, params)])
        draft_probs = None
        if any(r.spec_probs is not None for r in requests):  # a proposer without them drafts one-hot
            draft_probs = torch.cat([torch.nn.functional.one_hot(torch.tensor(d), target.shape[-1]).float()
                                     if r.spec_probs is None else r.spec_probs.detach().float().cpu()
                                     for d, r in zip(drafts, requests)])
        counts = torch.tensor([len(d) for d in drafts])
        out = self.rejection_sampler(torch.tensor([t for d in drafts for t in d], dtype=torch.long),
                                     counts.cumsum(0), draft_probs, target,
                                     torch.tensor(bonus, dtype=torch.long)[:, None],
                                     [p.greedy for p in params], generators)
        emitted = []
        for b, d in enumerate(drafts):
            row = [int(t) for t in out[b]]
            n = row.index(PLACEHOLDER_TOKEN_ID) if PLACEHOLDER_TOKEN_ID in row else len(row)
            if not 1 <= n <= len(d) + 1 or row[:n - 1] != d[:n - 1] or any(t != PLACEHOLDER_TOKEN_ID
                                                                           for t in row[n:]):
                raise ValueError(f"the rejection sampler returned {row} for request "
                                 f"{requests[b].request_id!r} with drafts {d}: expected the accepted drafts "
                                 f"(a prefix of them), then one token, then {PLACEHOLDER_TOKEN_ID}s")
            self.spec_stats.observe_draft(len(d), n - 1)
            emitted.append(row[:n])
        return emitted

    def _commit(self, request: Request, tokens: list[int]) -> RequestOutput:
        """Append this step's tokens up to the first stop condition; anything after it is dropped, and
        the request finishes there."""
        start = request.num_tokens
        keep, status = len(tokens), None
        for i, token in enumerate(tokens):
            status = self._stop_status(request, token, start + i + 1)
            if status is not None:
                keep = i + 1
                break
        request.append_token_ids(tokens[:keep])
        if self.spec_stats is not None:
            self.spec_stats.num_output_tokens += keep
        if status is not None:
            self.scheduler.finish(request, status)
            if self.proposer is not None:
                self.proposer.free(request.request_id)
        return self._output(request, tokens[:keep])

    def _fork(self, parent: Request, logits: torch.Tensor) -> list[tuple[Request, int]]:
        """Parallel sampling: the prompt is computed; make samples 1..n-1 share its blocks (copy on
        write) and draw their first tokens from the same logits. Returns (sample, token) pairs."""
        parent.forked = True
        p = parent.params
        children = []
        for i in range(1, p.n):
            params = replace(p, n=1, seed=None if p.seed is None else p.seed + i)
            child = Request((parent.request_id, i), parent.prompt_token_ids, params,
                            parent_id=parent.request_id, index=i, block_size=self.manager.block_size)
            child.forked = True
            self.scheduler.add_forked(parent, child)
            children.append(child)
        tokens = sample(logits.expand(len(children), -1), [c.params for c in children],
                        [c.generator for c in children])
        return list(zip(children, tokens))

    def _stop_status(self, request: Request, token: int, num_tokens: int) -> RequestStatus | None:
        """Does the request stop at `token`, which makes its length num_tokens?"""
        p = request.params
        if token in p.stop_token_ids or (not p.ignore_eos and token == self.eos_token_id):
            return RequestStatus.FINISHED_STOPPED
        if num_tokens - request.num_prompt_tokens >= p.max_tokens or num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    @staticmethod
    def _output(request: Request, new: list[int]) -> RequestOutput:
        return RequestOutput(request.request_id, request.prompt_token_ids, list(request.output_token_ids),
                             new, request.status, request.error, request.parent_id, request.index)

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
            others = [final[(request_id, k)].output_token_ids for k in range(1, n)]
            out.completions = [out.output_token_ids] + others
            results.append(out)
        return results
