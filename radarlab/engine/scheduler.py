"""FCFS continuous batching over the block manager, with chunked prefill and preemption by recompute.

Each step the scheduler hands out a token budget (max_num_batched_tokens), as vLLM v1 does: running
requests first, in arrival order (one token each for decodes, a chunk of the rest for prefills),
then waiting requests, admitted while there are sequence slots and budget and the whole request
fits the pool. A request gets blocks only for the tokens scheduled this step (vLLM's
allocate_slots); when a running request needs a block and none is free, the newest running request
is preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed
(prompt + outputs so far) later.

Speculative decoding (radarlab.spec_decode): a decoding request may carry drafts in spec_token_ids,
beside its tokens, never among them (vLLM v1's Request). They are scheduled with its last token
(num_tokens_with_spec), so they count in the token budget and get slots like any token (vLLM's
lookahead slots); drafts that do not fit the budget, or belong to a request that is preempted or not
scheduled, are dropped before the step runs. After verification, update() is the one place that sets
num_computed_tokens: the rejected drafts' positions count as not computed, and their slots stay
reserved (vLLM keeps the blocks too: the next tokens overwrite them).

Requests that can never run end with FINISHED_ERROR instead of waiting forever: a prompt longer
than max_model_len, or prompt + outputs needing more blocks than the whole pool.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Hashable

from radarlab.engine.request import Request, RequestStatus
from radarlab.kvcache.block_pool import NoFreeBlocks
from radarlab.kvcache.kv_cache_manager import AllocStatus, KVCacheManager
from radarlab.util import require_int, require_number


@dataclass
class SchedulerOutput:
    """What one forward step computes: for each scheduled request, tokens num_computed ..
    num_computed + num_scheduled - 1, whose slots lie in its blocks block_ids (copied when scheduled:
    the model runner reads no block manager, as in vLLM, whose output carries each request's block
    ids). copy_pairs must be copied in the pool before the step."""
    requests: list[Request] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    block_ids: list[list[int]] = field(default_factory=list)
    copy_pairs: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    errored: list[Request] = field(default_factory=list)
    num_spec_tokens: list[int] = field(default_factory=list)  # drafts among each request's scheduled tokens

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)


class Scheduler:
    def __init__(self, manager: KVCacheManager, max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                 max_model_len: int = 2048, watermark: float = 0.0) -> None:
        for name, value in [("max_num_seqs", max_num_seqs),
                            ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_model_len", max_model_len)]:
            require_int(name, value)
        if not 0.0 <= require_number("watermark", watermark) < 1.0:
            raise ValueError(f"watermark must be in [0, 1), a fraction of the pool, got {watermark!r}")
        # vLLM's SchedulerConfig.watermark: blocks kept free when admitting, so the running requests can
        # grow a while before anyone is preempted. Applied only when the step already runs something.
        self.watermark_blocks = int(watermark * manager.num_blocks)
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[Hashable, Request] = {}
        self.num_preemptions = 0
        self._errored: list[Request] = []  # finished with an error at add time, reported by the next step

    # --- queue ----------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_seats > self.max_num_seqs:
            raise ValueError(f"n={request.params.n} samples need {request.num_seats} sequence slots, "
                             f"more than max_num_seqs={self.max_num_seqs}")
        self.requests[request.request_id] = request
        if request.num_prompt_tokens > self.max_model_len:
            self._finish_error(request, f"prompt has {request.num_prompt_tokens} tokens, more than "
                                        f"max_model_len={self.max_model_len}")
            self._errored.append(request)
            return
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self._errored)

    def abort(self, request_id: Hashable) -> Request | None:
        """Finish a request now and free its blocks. Returns it, or None if it had already finished."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
            self._free(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED_ABORTED
        return request

    def finish(self, request: Request, status: RequestStatus) -> None:
        """A running request stopped (EOS, stop token, length): release its blocks."""
        self.running.remove(request)
        self._free(request)
        request.status = status
        self.requests.pop(request.request_id, None)

    # --- one step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        out.errored, self._errored = list(self._errored), []
        budget = self.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            computed = request.num_computed_tokens
            n = min(request.num_tokens_with_spec - computed, budget)  # 1 for a decode, a chunk, or 1 + drafts
            # drafts that do not fit the budget are dropped (they are guesses: nothing is lost)
            self._keep_drafts(request, computed + n - request.num_tokens)
            if not self._allocate_or_preempt(request, computed + n - self.manager.num_slots(request), out):
                break  # the request preempted itself: nothing after it is running
            self._schedule(out, request, computed, n)
            budget -= n
            i += 1
        for request in self.running[i:]:  # not scheduled this step: their drafts go
            self._keep_drafts(request, 0)

        # After a preemption admit nothing (the pool is short) unless nothing runs: then the pool is
        # all free, and the head either fits or can never fit (an error), so the step makes progress.
        may_admit = not (out.preempted and self.running)
        while may_admit and self.waiting and budget > 0:
            request = self.waiting[0]
            if len(self.running) + request.num_seats > self.max_num_seqs:
                break
            # the whole request must fit (reserve_full_isl), leaving the watermark to the running requests
            status = self.manager.can_allocate(request, self.watermark_blocks if out.requests else 0)
            if status is AllocStatus.NEVER:
                self.waiting.popleft()
                self._finish_error(request, f"{request.num_tokens} tokens need more blocks than the whole "
                                            f"pool ({self.manager.num_blocks} blocks of "
                                            f"{self.manager.block_size})")
                out.errored.append(request)
                continue
            if status is AllocStatus.LATER:
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            _, num_cached = self.manager.get_computed_blocks(request)
            n = min(request.num_tokens - num_cached, budget)
            request.num_computed_tokens = self.manager.allocate(request, n)  # blocks for this chunk only
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            self._schedule(out, request, request.num_computed_tokens, n)
            budget -= n

        if not out.requests and not out.errored and (self.waiting or self.running):
            raise RuntimeError(f"scheduler made no progress: {len(self.waiting)} waiting, "
                               f"{len(self.running)} running, {self.manager.num_free_blocks} free blocks")
        return out

    def add_forked(self, parent: Request, child: Request) -> None:
        """A sample forked from a running parent (n > 1): it shares the parent's blocks and runs
        right after it."""
        if child.request_id in self.requests:
            raise ValueError(f"request id {child.request_id!r} is already in use")
        self.manager.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RequestStatus.RUNNING
        self.requests[child.request_id] = child
        self.running.insert(self.running.index(parent) + child.index, child)

    def update(self, out: SchedulerOutput, num_rejected: list[int] | None = None) -> None:
        """After the forward pass and verification: the scheduled tokens now have K/V in the pool, but
        a rejected draft's position counts as not computed (its slot stays reserved, and the tokens
        that take the position overwrite it). The step's drafts are spent."""
        num_rejected = [0] * len(out.requests) if num_rejected is None else num_rejected
        if len(num_rejected) != len(out.requests):
            raise ValueError(f"num_rejected has {len(num_rejected)} entries for {len(out.requests)} requests")
        for request, n, k, rejected in zip(out.requests, out.num_scheduled_tokens, out.num_spec_tokens,
                                           num_rejected):
            if not 0 <= rejected <= k:
                raise ValueError(f"request {request.request_id!r}: {rejected} rejected of {k} drafts")
            request.num_computed_tokens += n - rejected
            request.spec_token_ids, request.spec_probs = [], None

    # --- helpers ---------------------------------------------------------------------------
    def _schedule(self, out: SchedulerOutput, request: Request, computed: int, n: int) -> None:
        out.requests.append(request)
        out.num_computed_tokens.append(computed)
        out.num_scheduled_tokens.append(n)
        out.block_ids.append(self.manager.get_block_table(request))
        out.num_spec_tokens.append(len(request.spec_token_ids))

    @staticmethod
    def _keep_drafts(request: Request, num_drafts: int) -> None:
        """Keep the request's first num_drafts drafts (and their probabilities); drop the rest."""
        keep = max(0, min(num_drafts, len(request.spec_token_ids)))
        if keep < len(request.spec_token_ids):
            request.spec_token_ids = request.spec_token_ids[:keep]
            probs = request.spec_probs
            request.spec_probs = probs[:keep] if probs is not None and keep else None

    def _allocate_or_preempt(self, request: Request, num_new_slots: int, out: SchedulerOutput) -> bool:
        """Reserve slots for the request's next num_new_slots tokens (its drafts' too, as lookahead;
        none where slots a rejected draft left already cover them), preempting the newest running
        requests until they fit. False if the request had to preempt itself."""
        while True:
            try:
                out.copy_pairs += self.manager.allocate_slots(request, max(0, num_new_slots),
                                                            len(request.spec_token_ids))
                return True
            except NoFreeBlocks:
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is request:
                    return False

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self._keep_drafts(request, 0)
        self._free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)

    def _free(self, request: Request) -> None:
        """Free the request's blocks; those whose K/V was never computed leave the prefix cache."""
        self.manager.free(request, request.num_computed_tokens)
        request.num_computed_tokens = 0

    def _finish_error(self, request: Request, message: str) -> None:
        request.status = RequestStatus.FINISHED_ERROR
        request.error = message
        self.requests.pop(request.request_id, None)
