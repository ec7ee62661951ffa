"""FCFS continuous batching over the block manager, with chunked prefill and preemption by recompute.

Each step the scheduler hands out a token budget (max_num_batched_tokens), as vLLM v1 does: running
requests first, in arrival order (one token each for decodes, a chunk of the rest for prefills),
then waiting requests, admitted while there are blocks, sequence slots and budget. When a running
request needs a block and none is free, the newest running request is preempted: its blocks are
freed and it goes back to the front of the queue, to be recomputed (prompt + outputs so far) later.

Requests that can never run end with FINISHED_ERROR instead of waiting forever: a prompt longer
than max_model_len, or prompt + outputs needing more blocks than the whole pool.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Hashable

from radarlab.kvcache.block_table import AllocStatus, BlockSpaceManager
from radarlab.kvcache.blocks import NoFreeBlocks, hash_block_chain
from radarlab.engine.request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """What one forward step computes: for each scheduled request, tokens num_computed ..
    num_computed + num_scheduled - 1. copy_pairs must be copied in the pool before the step."""
    requests: list[Request] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    copy_pairs: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    errored: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)


class Scheduler:
    def __init__(self, manager: BlockSpaceManager, max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                 max_model_len: int = 2048) -> None:
        for name, value in [("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens),
                            ("max_model_len", max_model_len)]:
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
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
            raise ValueError(f"n={request.params.n} samples need {request.num_seats} sequence slots, more than "
                             f"max_num_seqs={self.max_num_seqs}")
        self.requests[request.request_id] = request
        if len(request.prompt_token_ids) > self.max_model_len:
            self._finish_error(request, f"prompt has {len(request.prompt_token_ids)} tokens, more than "
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
        pending: set[int] = set()  # full blocks whose K/V will still be missing after this step

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            sid = request.request_id
            if request.num_computed_tokens == self.manager.num_tokens(sid):  # decode: slot for the last token
                if not self._append_or_preempt(request, out):
                    break  # the request preempted itself: nothing after it is running
            computed = request.num_computed_tokens
            n = min(self.manager.num_tokens(sid) - computed, budget)
            self._schedule(out, request, computed, n, pending)
            budget -= n
            i += 1
        for request in self.running[i:]:  # not reached this step; their uncomputed blocks stay pending
            self._mark_pending(request, request.num_computed_tokens, pending)

        # After a preemption admit nothing (the pool is short) unless nothing runs: then the pool is
        # all free, and the head either fits or can never fit (an error), so the step makes progress.
        may_admit = not (out.preempted and self.running)
        while may_admit and self.waiting and budget > 0:
            request = self.waiting[0]
            if len(self.running) + request.num_seats > self.max_num_seqs:
                break
            token_ids = request.all_token_ids
            status = self.manager.can_allocate(token_ids)
            if status is AllocStatus.NEVER:
                self.waiting.popleft()
                self._finish_error(request, f"{len(token_ids)} tokens need more blocks than the whole pool "
                                            f"({self.manager.num_blocks} blocks of {self.manager.block_size})")
                out.errored.append(request)
                continue
            if status is AllocStatus.LATER or self._hits_pending(token_ids, pending):
                break  # FCFS: nobody overtakes the head of the queue
            self.waiting.popleft()
            request.num_computed_tokens = self.manager.allocate(request.request_id, token_ids)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            n = min(len(token_ids) - request.num_computed_tokens, budget)
            self._schedule(out, request, request.num_computed_tokens, n, pending)
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
        self.manager.fork(parent.request_id, child.request_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RequestStatus.RUNNING
        self.requests[child.request_id] = child
        self.running.insert(self.running.index(parent) + child.index, child)

    def update(self, out: SchedulerOutput) -> None:
        """After the forward pass: the scheduled tokens now have K/V in the pool."""
        for request, n in zip(out.requests, out.num_scheduled_tokens):
            request.num_computed_tokens += n

    # --- helpers ---------------------------------------------------------------------------
    def _schedule(self, out, request, computed, n, pending) -> None:
        out.requests.append(request)
        out.num_computed_tokens.append(computed)
        out.num_scheduled_tokens.append(n)
        self._mark_pending(request, computed + n, pending)

    def _mark_pending(self, request: Request, computed_after: int, pending: set[int]) -> None:
        pending.update(self.manager.get_block_table(request.request_id)[computed_after // self.manager.block_size:])

    def _hits_pending(self, token_ids: list[int], pending: set[int]) -> bool:
        """Would a prefix-cache hit land on a block another request has registered but not yet
        computed (a chunked prefill in flight)? Then wait: its K/V is not there to read."""
        allocator = self.manager.allocator
        if not allocator.enable_prefix_caching or not pending:
            return False
        hit = allocator.find_longest_cache_hit(hash_block_chain(token_ids[:-1], self.manager.block_size))
        return any(b in pending for b in hit)

    def _append_or_preempt(self, request: Request, out: SchedulerOutput) -> bool:
        """Reserve a slot for the request's newest token, preempting the newest running requests
        until it fits. False if the request had to preempt itself."""
        while True:
            try:
                out.copy_pairs += self.manager.append_slots(request.request_id, request.output_token_ids[-1:])
                return True
            except NoFreeBlocks:
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is request:
                    return False

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self._free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)

    def _free(self, request: Request) -> None:
        """Free the request's blocks; those whose K/V was never computed leave the prefix cache."""
        self.manager.free(request.request_id, request.num_computed_tokens)
        request.num_computed_tokens = 0

    def _finish_error(self, request: Request, message: str) -> None:
        request.status = RequestStatus.FINISHED_ERROR
        request.error = message
        self.requests.pop(request.request_id, None)
