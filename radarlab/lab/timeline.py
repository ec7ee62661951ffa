"""What the engine did at every step, recorded for timelines, utilisation and latency (notebook 05).

`record_step` runs one `Engine.step()` and reads `engine.last_scheduled` (the scheduler's output
for that step): which requests ran, from which position, with how many tokens, and who was
preempted. `run_recorded` steps until every request has finished. The rest are pure functions of
the records: the state of each request at each step (for the plot in radarlab.viz.timeline_plot), slot
utilisation, peak concurrency, the tokens generated, and when each came out (for TTFT and
inter-token latency).

A scheduled request's work is one of
- "prefill": a chunk of its prompt (the whole prompt, or a piece of it under chunked prefill). A
  sample forked from a parent (n > 1) shares the parent's prefill: it is recorded as a prefill of
  0 tokens in the step that forked it, with its first token;
- "recompute": a chunk of prompt + outputs again, after a preemption freed its blocks;
- "decode": the one newest output token;
- "verify": the newest output token and the drafts after it (speculative decoding); the step may
  emit several tokens.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Hashable, Sequence

PREFILL, RECOMPUTE, DECODE, VERIFY = "prefill", "recompute", "decode", "verify"
WAITING, DONE = "waiting", "done"
STATES = (WAITING, PREFILL, RECOMPUTE, DECODE, VERIFY, DONE)


@dataclass(frozen=True)
class ScheduledWork:
    """One request's share of a step: tokens num_computed_tokens .. num_computed_tokens + num_tokens - 1."""
    request_id: Hashable
    kind: str  # PREFILL, RECOMPUTE, DECODE or VERIFY
    num_computed_tokens: int
    num_tokens: int
    # the (last) token the step emitted for it; None while its prompt (or recompute) is incomplete
    token: int | None
    # every token the step emitted (several after a verify); () means (token,)
    new_token_ids: tuple[int, ...] = ()

    @property
    def tokens(self) -> tuple[int, ...]:
        """The tokens this step emitted for the request."""
        return self.new_token_ids or (() if self.token is None else (self.token,))

    @property
    def sampled(self) -> bool:
        return self.token is not None


@dataclass(frozen=True)
class StepRecord:
    """One engine step. waiting: unfinished requests that got no tokens (queued, preempted, or
    running but past the token budget). num_running: requests holding blocks during the step.
    num_used_blocks is read after the step, when finished requests have freed theirs."""
    step: int
    scheduled: tuple[ScheduledWork, ...]
    waiting: tuple[Hashable, ...]
    preempted: tuple[Hashable, ...]
    finished: tuple[Hashable, ...]
    num_running: int
    num_used_blocks: int
    seconds: float

    @property
    def num_tokens(self) -> int:
        return sum(w.num_tokens for w in self.scheduled)

    def work(self, request_id: Hashable) -> ScheduledWork | None:
        for w in self.scheduled:
            if w.request_id == request_id:
                return w
        return None


def _kind(request, num_computed: int, num_tokens: int, num_spec_tokens: int = 0) -> str:
    if num_spec_tokens:
        return VERIFY
    if num_computed >= len(request.prompt_token_ids) and num_tokens == 1 and num_computed > 0:
        return DECODE
    return RECOMPUTE if request.num_preemptions > 0 else PREFILL


def record_step(engine, step: int) -> tuple[list, StepRecord]:
    """Run engine.step() once; return its outputs and what it did, as a StepRecord numbered `step`."""
    t0 = time.perf_counter()
    outputs = engine.step()
    seconds = time.perf_counter() - t0
    sched = engine.last_scheduled
    if sched is None:
        raise RuntimeError("engine.last_scheduled is None after a step: this Engine "
                           "does not record its steps")
    sampled = {o.request_id: tuple(o.new_token_ids) for o in outputs if o.new_token_ids}
    finished = tuple(o.request_id for o in outputs if o.finished)
    spec = sched.num_spec_tokens or [0] * len(sched.requests)
    scheduled = tuple(
        ScheduledWork(r.request_id, _kind(r, done, n, k), done, n, new[-1] if new else None, new)
        for r, done, n, k in zip(sched.requests, sched.num_computed_tokens, sched.num_scheduled_tokens, spec)
        for new in [sampled.get(r.request_id, ())])
    ran = {w.request_id for w in scheduled}
    scheduled += tuple(  # parallel sampling (n > 1): samples forked from a parent whose prompt just finished
        ScheduledWork(o.request_id, PREFILL, 0, 0, o.new_token_ids[-1]) for o in outputs
        if o.new_token_ids and o.request_id not in ran)
    ran = {w.request_id for w in scheduled}
    waiting = tuple(rid for rid in engine.scheduler.requests if rid not in ran)  # unfinished, no tokens
    running = {r.request_id for r in engine.scheduler.running} | (ran & set(finished))
    return outputs, StepRecord(step, scheduled, waiting, tuple(r.request_id for r in sched.preempted),
                               finished, len(running), engine.manager.block_pool.num_used_blocks, seconds)


def run_recorded(engine, first_step: int = 0, max_steps: int = 100_000) -> list[StepRecord]:
    """Step the engine until every request it holds has finished; one record per step, numbered
    from first_step (pass len(records) to continue an earlier timeline)."""
    records = []
    while engine.has_unfinished_requests():
        if len(records) >= max_steps:
            raise RuntimeError(f"requests still unfinished after {max_steps} steps")
        records.append(record_step(engine, first_step + len(records))[1])
    return records


# --- reading the records ---------------------------------------------------------------------------

def state_grid(records: Sequence[StepRecord], request_ids: Sequence[Hashable]) -> list[list[str]]:
    """grid[i][s]: what request_ids[i] was doing at records[s]: PREFILL, RECOMPUTE or DECODE when
    scheduled, DONE from the step after it finished, WAITING otherwise. Every request counts as
    arrived at the first record (a request not yet handed to the engine is waiting for it)."""
    grid = []
    for rid in request_ids:
        row, done = [], False
        for rec in records:
            work = rec.work(rid)
            row.append(work.kind if work else (DONE if done else WAITING))
            done = done or rid in rec.finished
        grid.append(row)
    return grid


def slot_utilisation(records: Sequence[StepRecord], max_num_seqs: int) -> float:
    """Fraction of the max_num_seqs seats that did work, over all steps (1.0: every seat, every step)."""
    if not records:
        raise ValueError("records is empty")
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    return sum(len(r.scheduled) for r in records) / (len(records) * max_num_seqs)


def max_running(records: Sequence[StepRecord]) -> int:
    """The most requests that held blocks at once."""
    return max((r.num_running for r in records), default=0)


def _per_sampled_token(records: Sequence[StepRecord], value) -> dict[Hashable, list]:
    """For each request, value(record, work, token) of every token it got, in order (a verify step
    gives several tokens in one step)."""
    out: dict[Hashable, list] = {}
    for rec in records:
        for w in rec.scheduled:
            for token in w.tokens:
                out.setdefault(w.request_id, []).append(value(rec, w, token))
    return out


def token_steps(records: Sequence[StepRecord]) -> dict[Hashable, list[int]]:
    """For each request, the step at which it got each new token, in order."""
    return _per_sampled_token(records, lambda rec, w, token: rec.step)


def output_token_ids(records: Sequence[StepRecord]) -> dict[Hashable, list[int]]:
    """For each request, the tokens it generated during the records, in order."""
    return _per_sampled_token(records, lambda rec, w, token: token)


def token_times(records: Sequence[StepRecord]) -> dict[Hashable, list[float]]:
    """For each request, the wall time (seconds since the first record began) at which each of its
    tokens came out: the end of the step that sampled it."""
    out: dict[Hashable, list[float]] = {}
    clock = 0.0
    for rec in records:
        clock += rec.seconds
        for w in rec.scheduled:
            if w.tokens:
                out.setdefault(w.request_id, []).extend([clock] * len(w.tokens))
    return out


def latency_metrics(arrival: Sequence[float], token_times: Sequence[Sequence[float]]
                    ) -> list[tuple[float, float | None]]:
    """(TTFT, mean inter-token latency) per request. TTFT = first token - arrival; the mean ITL is
    the mean gap between consecutive tokens, (last - first) / (n - 1). A request with one token has
    no gap: its ITL is None, and it is left out of ITL averages (as vLLM's benchmark leaves it out)."""
    if len(arrival) != len(token_times):
        raise ValueError(f"{len(arrival)} arrival times for {len(token_times)} token-time lists")
    out = []
    for i, (t0, times) in enumerate(zip(arrival, token_times)):
        if not times:
            raise ValueError(f"request {i} has no tokens: TTFT is undefined")
        itl = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        out.append((times[0] - t0, itl))
    return out
