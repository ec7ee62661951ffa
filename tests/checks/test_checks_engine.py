"""The checkers of notebook 05: the reference solutions pass, typical mistakes fail with a plain
counterexample, and the exercise's token-budget rule is the one radarlab's Scheduler follows."""
from __future__ import annotations

import random

import pytest

from radarlab.checks import (
    check_latency_metrics,
    check_preemption_rule,
    check_schedule_token_budget,
    check_scheduler,
)
from radarlab.checks.nb05_batching import _schedule_token_budget_reference
from radarlab.engine import Request, RequestStatus, SamplingParams, Scheduler, SchedulerOutput
from radarlab.kvcache.block_pool import NoFreeBlocks
from radarlab.kvcache.kv_cache_manager import AllocStatus, KVCacheManager

# --- schedule_token_budget -------------------------------------------------------------------------

def budget_rule(running, waiting, budget, max_num_seqs):
    """The exercise's rule written out plainly, as the oracle: running requests first, in order (a
    decode takes 1 token, a prefill a chunk of what is left), then the queue in FCFS order while
    budget and seats remain."""
    running_tokens = []
    for remaining in running:
        n = min(remaining if remaining > 0 else 1, budget)
        running_tokens.append(n)
        budget -= n
    waiting_tokens, seats = [], max_num_seqs - len(running)
    for prompt_len in waiting:
        n = min(prompt_len, budget) if budget > 0 and seats > 0 else 0
        if n:
            seats -= 1
            budget -= n
        waiting_tokens.append(n)
    return running_tokens, waiting_tokens


# The learner's solution in the notebook is checked by nbval; here the rule above plays it.
schedule_token_budget = budget_rule


def _decode_takes_nothing(running, waiting, budget, max_num_seqs):
    r, w = schedule_token_budget([max(x, 0) for x in running], waiting, budget, max_num_seqs)
    return [0 if x == 0 else n for x, n in zip(running, r)], w


def _waiting_first(running, waiting, budget, max_num_seqs):
    w, r = schedule_token_budget([], waiting, budget, max_num_seqs - len(running))
    left = budget - sum(r)
    return schedule_token_budget(running, [], left, max_num_seqs)[0], r


def _admit_whole_prompts(may_overtake):
    """Wrong: waiting prompts are admitted only whole (no chunk), and, if may_overtake, a prompt
    that does not fit lets the ones behind it in."""
    def schedule(running, waiting, budget, max_num_seqs):
        r, _ = schedule_token_budget(running, [], budget, max_num_seqs)
        budget -= sum(r)
        seats, w = max_num_seqs - len(running), []
        for p in waiting:
            if p <= budget and seats > 0 and (may_overtake or not w or w[-1] > 0):
                w.append(p)
                budget -= p
                seats -= 1
            else:
                w.append(0)
        return r, w
    return schedule


_whole_prompts_only = _admit_whole_prompts(may_overtake=False)
_overtakes = _admit_whole_prompts(may_overtake=True)


def _seats_ignore_running(running, waiting, budget, max_num_seqs):
    return schedule_token_budget(running, waiting, budget, max_num_seqs + len(running))


def _one_list(running, waiting, budget, max_num_seqs):
    r, w = schedule_token_budget(running, waiting, budget, max_num_seqs)
    return r + w


def test_schedule_token_budget_solution_passes(verdict):
    verdict(check_schedule_token_budget, schedule_token_budget)


@pytest.mark.parametrize("fn,message", [
    (_decode_takes_nothing, "it returned ([0, 0, 0], [5]), expected ([1, 1, 1], [5]) (each decode takes 1 "
                            "token"),
    (_waiting_first, "it returned ([0, 0], [16, 0]), expected ([1, 1], [14, 0]) (running requests are "
                     "served first"),
    (_whole_prompts_only, "it returned ([1, 1], [0, 0]), expected ([1, 1], [14, 0]) (the head of the queue "
                          "is "
                          "admitted with a chunk"),
    (_overtakes, "it returned ([1, 1], [0, 3]), expected ([1, 1], [14, 0])"),
    (_seats_ignore_running, "expected ([1, 1, 1], [2, 0, 0]) (max_num_seqs counts the running requests too"),
    (_one_list, "expected two lists of ints"),
])
def test_schedule_token_budget_mistakes_fail(verdict, fn, message):
    verdict(check_schedule_token_budget, fn, message)


@pytest.mark.parametrize("case", [([0, 0, 0], [5], 16, 8), ([0, 0, 50], [], 16, 8), ([0, 0], [40, 3], 16, 8),
                                  ([0, 0, 0], [2, 2, 2], 100, 4), ([], [10, 20, 5], 32, 2),
                                  ([0, 30], [4], 16, 8),
                                  ([], [], 8, 4), ([0] * 5 + [70], [7, 33, 2, 12, 40, 1], 64, 10)])
def test_checker_reference_follows_the_rule(case):
    """The checker's reference (radarlab's Scheduler set up in that state) answers as the rule does."""
    assert _schedule_token_budget_reference(*case) == budget_rule(*case)


@pytest.mark.parametrize("seed", range(6))
def test_reference_rule_is_the_schedulers_rule(seed):
    """Drive radarlab's Scheduler (a roomy pool, no prefix caching, no model: outputs are made up) and
    check that every step hands out exactly the tokens the exercise's rule gives for the state before
    the step."""
    rng = random.Random(seed)
    budget, seats = rng.choice([(8, 4), (16, 3), (24, 6), (64, 8)])
    manager = KVCacheManager(num_blocks=4096, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(manager, max_num_seqs=seats, max_num_batched_tokens=budget, max_model_len=4096)
    pending = [[rng.randrange(100) for _ in range(rng.randint(1, 50))] for _ in range(12)]
    max_tokens = {i: rng.randint(1, 6) for i in range(len(pending))}
    steps = 0
    while pending or scheduler.has_unfinished_requests():
        for _ in range(rng.randint(0, 2)):  # new arrivals between steps
            if pending:
                i = len(max_tokens) - len(pending)
                scheduler.add_request(Request(i, pending.pop(0), SamplingParams(max_tokens=max_tokens[i])))
        if not scheduler.has_unfinished_requests():
            continue
        running = [0 if r.num_output_tokens else r.num_tokens - r.num_computed_tokens
                   for r in scheduler.running]
        waiting = [r.num_tokens for r in scheduler.waiting]
        want_running, want_waiting = budget_rule(running, waiting, budget, seats)
        before_running = [r.request_id for r in scheduler.running]
        before_waiting = [r.request_id for r in scheduler.waiting]
        out = scheduler.schedule()
        got = dict(zip([r.request_id for r in out.requests], out.num_scheduled_tokens))
        assert [got.get(i, 0) for i in before_running] == want_running
        assert [got.get(i, 0) for i in before_waiting] == want_waiting
        scheduler.update(out)
        for request in out.requests:  # what the engine does after the forward pass
            if request.num_computed_tokens == request.num_tokens:
                request.append_token_ids([rng.randrange(100)])
                if request.num_output_tokens >= request.params.max_tokens:
                    scheduler.finish(request, request.status.FINISHED_LENGTH)
        steps += 1
    assert steps > 10 and manager.num_free_blocks == 4096


# --- latency_metrics -------------------------------------------------------------------------------

def latency_metrics(arrival, token_times):
    return [(t[0] - a, (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None) for a,
            t in zip(arrival, token_times)]


def _none_everywhere(arrival, token_times):
    return [(t[0] - a, None) for a, t in zip(arrival, token_times)]


def _ttft_from_zero(arrival, token_times):
    return [(t[0], itl) for t, (_, itl) in zip(token_times, latency_metrics(arrival, token_times))]


def _itl_includes_ttft(arrival, token_times):
    return [(ttft, (t[-1] - a) / len(t) if len(t) > 1 else None)
            for a, t, (ttft, _) in zip(arrival, token_times, latency_metrics(arrival, token_times))]


def _itl_over_n(arrival, token_times):
    return [(ttft, (t[-1] - t[0]) / len(t) if len(t) > 1 else None)
            for t, (ttft, _) in zip(token_times, latency_metrics(arrival, token_times))]


def _one_token_zero(arrival, token_times):
    return [(ttft, 0.0 if itl is None else itl) for ttft, itl in latency_metrics(arrival, token_times)]


def _one_token_crashes(arrival, token_times):
    return [(t[0] - a, (t[-1] - t[0]) / (len(t) - 1)) for a, t in zip(arrival, token_times)]


def _median_gap(arrival, token_times):
    out = []
    for a, t in zip(arrival, token_times):
        gaps = sorted(y - x for x, y in zip(t, t[1:]))
        out.append((t[0] - a, gaps[len(gaps) // 2] if gaps else None))
    return out


def test_latency_metrics_solution_passes(verdict):
    verdict(check_latency_metrics, latency_metrics)


@pytest.mark.parametrize("fn,message", [
    (_ttft_from_zero, "request 1's TTFT was 1.6, expected 0.6"),
    (_itl_includes_ttft, "(the wait for the first token is TTFT, not a gap between tokens)"),
    (_itl_over_n, "(3 tokens have 2 gaps between them)"),
    (_one_token_zero, "request 0 has one token and its ITL was 0; expected None"),
    (_one_token_crashes, "it raised ZeroDivisionError"),
    (_median_gap, "request 1's mean ITL was 0.3, expected 0.2 (the mean of the gaps between consecutive "
                  "tokens)"),
    (_none_everywhere, "request 0's mean ITL was None, expected 0.2"),
])
def test_latency_metrics_mistakes_fail(verdict, fn, message):
    verdict(check_latency_metrics, fn, message)


# --- preemption rule -------------------------------------------------------------------------------
def preempt(running, free_blocks, victim=-1):
    """The notebook's solution (victim=-1: the newest running request goes first)."""
    alive = list(range(len(running)))
    preempted = []
    for i, (held, needs_new_block) in enumerate(running):
        if i >= len(alive):
            break
        if not needs_new_block:
            continue
        while free_blocks == 0:
            gone = alive.pop(victim)
            preempted.append(gone)
            free_blocks += running[gone][0]
        if i in preempted:
            break
        free_blocks -= 1
    return preempted


def _oldest_first(running, free_blocks):
    return preempt(running, free_blocks, victim=0)


def _never_frees(running, free_blocks):
    alive, preempted = list(range(len(running))), []
    for i, (held, needs) in enumerate(running):
        if i >= len(alive):
            break
        if needs and free_blocks == 0:
            victim = alive.pop()
            preempted.append(victim)  # but its blocks are not returned to the pool
            if victim == i:
                break
        elif needs:
            free_blocks -= 1
    return preempted


def test_preemption_solution_passes(verdict):
    verdict(check_preemption_rule, preempt, name="preempt")


@pytest.mark.parametrize("fn,message", [
    (_oldest_first, "preempt the newest running request"),
    (_never_frees, "frees all the blocks it holds"),
    (lambda running, free: [], "it returned [], expected [1]"),
])
def test_preemption_mistakes_fail(verdict, fn, message):
    verdict(check_preemption_rule, fn, message, name="preempt")


# --- scheduler (the main exercise): schedule() written as a learner would, without drafts -------------

def learner_scheduler(mistake: str | None = None):
    """A learner's Scheduler subclass; `mistake` names one plausible error to make on purpose."""

    class LearnerScheduler(Scheduler):
        def schedule(self):
            out = SchedulerOutput()
            out.errored, self._errored = list(self._errored), []
            budget = self.max_num_batched_tokens
            i = 0
            while i < len(self.running) and budget > 0:
                request = self.running[i]
                n = request.num_tokens - request.num_computed_tokens
                if mistake != "running ignore the budget":
                    n = min(n, budget)
                while True:
                    try:
                        out.copy_pairs += self.manager.allocate_slots(request, n)
                        break
                    except NoFreeBlocks:
                        victim = self.running.pop(0 if mistake == "preempt the oldest" else -1)
                        self._preempt(victim, out)
                        if victim is request:
                            break
                if request.status is RequestStatus.PREEMPTED:
                    break
                self._schedule(out, request, request.num_computed_tokens, n)
                budget -= n
                i += 1
            may_admit = not (out.preempted and self.running)
            skipped = 0
            while may_admit and len(self.waiting) > skipped and budget > 0:
                request = self.waiting[skipped]
                full = len(self.running) + request.num_seats > self.max_num_seqs
                if full and mistake != "ignore max_num_seqs":
                    break
                status = self.manager.can_allocate(request, self.watermark_blocks if out.requests else 0)
                if status is AllocStatus.NEVER:
                    del self.waiting[skipped]
                    self._finish_error(request, "never fits")
                    out.errored.append(request)
                    continue
                if status is AllocStatus.LATER:
                    if mistake == "overtake the head":
                        skipped += 1
                        continue
                    break
                _, num_cached = self.manager.get_computed_blocks(request)
                n = request.num_tokens - (0 if mistake == "ignore the prefix cache" else num_cached)
                if mistake == "no chunked prefill" and n > budget:
                    break
                n = min(n, budget)
                del self.waiting[skipped]
                request.num_computed_tokens = self.manager.allocate(request, n)
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                self._schedule(out, request, request.num_computed_tokens, n)
                budget -= n
            return out

    return LearnerScheduler


def test_scheduler_solution_passes(verdict):
    verdict(check_scheduler, learner_scheduler())


@pytest.mark.parametrize("mistake, message", [
    ("running ignore the budget", "chunked prefill: 16, 16, 8"),
    ("preempt the oldest", "preempt the newest running request"),
    ("overtake the head", "FCFS: the head does not fit yet, so nobody behind it starts"),
    ("ignore max_num_seqs", "at most 2 run at once"),
    ("ignore the prefix cache", "prefix caching on (a cached prefix is not recomputed"),
    ("no chunked prefill", "chunked prefill"),
])
def test_scheduler_mistakes_fail(verdict, mistake, message):
    verdict(check_scheduler, learner_scheduler(mistake), message)
