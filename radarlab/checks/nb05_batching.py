"""Checkers of notebook 05 (continuous batching): the token budget, the preemption rule, latency metrics."""
from __future__ import annotations

from radarlab.checks.common import call_learner, verdict


def _put_running(scheduler, request_id, num_prompt_tokens: int, num_computed: int, decoding: bool):
    """A request placed straight into the scheduler's running list, as if earlier steps had computed
    its first num_computed tokens (and reserved their slots); a decoding one also holds the token it
    sampled last, not computed yet. How the checkers' references set up a state to schedule from."""
    from radarlab.engine import Request, RequestStatus, SamplingParams

    request = Request(request_id, [1] * num_prompt_tokens, SamplingParams())
    scheduler.manager.allocate(request, num_computed)
    request.num_computed_tokens = num_computed
    if decoding:
        request.append_token_ids([1])
    request.status = RequestStatus.RUNNING
    scheduler.running.append(request)
    return request


def _schedule_token_budget_reference(running, waiting, budget, max_num_seqs):
    """The answer of radarlab's own Scheduler (vLLM v1's rule) on a pool roomy enough that blocks
    never bind: running requests with `remaining` prompt tokens still to prefill (0: decoding), then
    waiting prompts of the given lengths, head first."""
    from radarlab.engine import Request, SamplingParams, Scheduler
    from radarlab.kvcache.kv_cache_manager import KVCacheManager

    manager = KVCacheManager(num_blocks=1024, block_size=16, enable_prefix_caching=False)
    scheduler = Scheduler(manager, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
    done_prefill = 8  # tokens each running request has computed already
    requests = [_put_running(scheduler, ("running", i), done_prefill + remaining,
                             done_prefill, remaining == 0)
                for i, remaining in enumerate(running)]
    for i, prompt_len in enumerate(waiting):
        request = Request(("waiting", i), [1] * prompt_len, SamplingParams())
        scheduler.add_request(request)
        requests.append(request)
    out = scheduler.schedule()
    scheduled = dict(zip((r.request_id for r in out.requests), out.num_scheduled_tokens))
    tokens = [scheduled.get(r.request_id, 0) for r in requests]
    return tokens[:len(running)], tokens[len(running):]


def check_schedule_token_budget(schedule_token_budget) -> bool:
    """Check a learner's schedule_token_budget(running, waiting, budget, max_num_seqs) -> (running_tokens,
    waiting_tokens). running: prompt tokens each running request still has to prefill (0 = decoding);
    waiting: prompt lengths of the queue, head first. Each case names the rule it tests."""
    import random

    name = "schedule_token_budget"
    rng = random.Random(5)
    big_running = [0] * 5 + [70]
    big_waiting = [rng.randint(1, 40) for _ in range(6)]
    cases = [  # (description, running, waiting, budget, max_num_seqs, the rule it tests)
        ("running=[0, 0, 0] (three decodes), waiting=[5], budget=16, max_num_seqs=8", [0, 0, 0], [5], 16, 8,
         "each decode takes 1 token; the 5-token prompt fits in what is left"),
        ("running=[0, 0, 50] (two decodes, then a prompt with 50 tokens left), waiting=[], budget=16, "
         "max_num_seqs=8",
         [0, 0, 50], [], 16, 8, "a running prefill takes a chunk of what is left of the budget: 16 - 2 = 14"),
        ("running=[0, 0], waiting=[40, 3], budget=16, max_num_seqs=8", [0, 0], [40, 3], 16, 8,
         "the head of the queue is admitted with a chunk of the 14 tokens left (chunked prefill); the "
         "3-token prompt behind it then finds no budget: nobody overtakes the head"),
        ("running=[0, 0, 0], waiting=[2, 2, 2], budget=100, max_num_seqs=4", [0, 0, 0], [2, 2, 2], 100, 4,
         "max_num_seqs counts the running requests too: 3 run, so one seat is left"),
        ("running=[], waiting=[10, 20, 5], budget=32, max_num_seqs=2", [], [10, 20, 5], 32, 2,
         "two seats: the third request waits although 2 tokens of budget are left"),
        ("running=[0, 30], waiting=[4], budget=16, max_num_seqs=8", [0, 30], [4], 16, 8,
         "running requests are served first, in order; the prefill uses up the budget and the queue gets "
         "nothing"),
        ("running=[], waiting=[], budget=8, max_num_seqs=4 (an idle engine)", [], [], 8, 4,
         "nothing to schedule: two empty lists"),
        (f"running={big_running}, waiting={big_waiting}, budget=64, max_num_seqs=10",
         big_running, big_waiting, 64,
         10, "the same rules on a larger step"),
    ]
    for description, running, waiting, budget, seats, rule in cases:
        want = _schedule_token_budget_reference(running, waiting, budget, seats)
        got, problem = call_learner(lambda: schedule_token_budget(list(running),
                                                                  list(waiting), budget, seats),
                                    description)
        if problem:
            return verdict(name, problem)
        try:
            got_lists = ([int(n) for n in got[0]], [int(n) for n in got[1]])
            if len(got) != 2:
                raise ValueError
        except (TypeError, ValueError, IndexError, KeyError):
            return verdict(name, f"for {description} it returned {got!r}; expected two lists of ints "
                                 f"(running_tokens, waiting_tokens), here {want}")
        if got_lists != want:
            if sum(got_lists[0]) < sum(want[0]) and sum(got_lists[1]) > sum(want[1]):
                rule = "running requests are served first, then the queue gets what is left"
            return verdict(name, f"for {description} it returned {got_lists}, expected {want} ({rule})")
    return verdict(name, None)


def _preemption_reference(running, free_blocks, block_size=4):
    """Which running requests radarlab's Scheduler preempts this step, in order, set up in that state:
    running[i] = (blocks_held, needs_new_block) in arrival order, every request decoding, free_blocks
    free in the pool."""
    from radarlab.engine import Scheduler
    from radarlab.kvcache.kv_cache_manager import KVCacheManager

    manager = KVCacheManager(sum(held for held, _ in running) + free_blocks, block_size,
                             enable_prefix_caching=False)
    scheduler = Scheduler(manager, max_num_seqs=max(1, len(running)), max_num_batched_tokens=4096,
                          max_model_len=4096)
    for i, (held, needs_new) in enumerate(running):
        # a full last block means the next token needs a new one; one slot left means it does not
        computed = held * block_size - (0 if needs_new else 1)
        _put_running(scheduler, i, computed, computed, decoding=True)
    return [r.request_id for r in scheduler.schedule().preempted]


def check_preemption_rule(preempt) -> bool:
    """Check a learner's preempt(running, free_blocks) -> preempted indices, in the order preempted.
    running[i] = (blocks_held, needs_new_block), oldest first; each request needing a block takes one,
    and when none is free the newest running request is preempted (its blocks freed) until it fits,
    or until the request itself was the newest. The reference is radarlab's Scheduler in that state."""
    import random

    name = "preempt"
    rng = random.Random(9)
    cases = [  # (description, running, free_blocks)
        ("running=[(2, True), (2, True)], free_blocks=1 (both need a block, one is free)",
         [(2, True), (2, True)], 1),
        ("running=[(1, True), (3, False), (1, True)], free_blocks=0",
         [(1, True), (3, False), (1, True)], 0),
        ("running=[(1, False), (1, False)], free_blocks=0 (nobody needs a block)",
         [(1, False), (1, False)], 0),
        ("running=[(3, True)], free_blocks=0 (alone and out of blocks: it preempts itself)", [(3, True)], 0),
        ("running=[(1, True), (1, True), (1, True), (1, True)], free_blocks=0 (each victim frees one block)",
         [(1, True)] * 4, 0),
        ("running=[(1, True), (2, False), (1, True)], free_blocks=0 (a victim that needed nothing still "
         "frees its blocks)", [(1, True), (2, False), (1, True)], 0),
        ("running=[(1, True), (1, True), (3, False)], free_blocks=0 (the victim frees 3 blocks: enough for "
         "both)", [(1, True), (1, True), (3, False)], 0),
        ("running=[], free_blocks=3 (nothing runs)", [], 3),
    ]
    for k in range(6):
        running = [(rng.randint(1, 4), rng.random() < 0.6) for _ in range(rng.randint(2, 8))]
        free = rng.randint(0, 2)
        cases.append((f"random case {k + 1}: running={running}, free_blocks={free}", running, free))
    for description, running, free in cases:
        want = _preemption_reference(running, free)
        got, problem = call_learner(lambda: preempt(list(running), free), description)
        if problem:
            return verdict(name, problem)
        try:
            got_list = [int(i) for i in got]
        except TypeError:
            return verdict(name, f"for {description} it returned {got!r}; expected a list of indices {want}")
        if got_list != want:
            if sorted(got_list) == sorted(want):
                hint = " (the same requests, in another order: preempt the newest first)"
            elif want and got_list and got_list[0] == 0 != want[0]:
                hint = " (preempt the newest running request, the last in the list, not the oldest)"
            else:
                hint = (" (each preempted request frees all the blocks it holds, and serving continues in "
                        "arrival order)")
            return verdict(name, f"for {description} it returned {got_list}, expected {want}{hint}")
    return verdict(name, None)


def check_latency_metrics(latency_metrics) -> bool:
    """Check a learner's latency_metrics(arrival, token_times) -> [(ttft, mean_itl), ...] against
    radarlab.lab.timeline.latency_metrics: TTFT from each request's own arrival, the mean gap
    between its tokens, and None as the ITL of a one-token output."""
    import math
    import random

    from radarlab.lab.timeline import latency_metrics as reference

    name = "latency_metrics"
    rng = random.Random(3)
    arrivals = sorted(round(rng.uniform(0, 5), 3) for _ in range(5))
    times = []
    for a, n in zip(arrivals, [1, 4, 2, 7, 3]):
        t, ts = a + rng.uniform(0.1, 2), []
        for _ in range(n):
            ts.append(round(t, 3))
            t += rng.uniform(0.02, 0.3)
        times.append(ts)
    cases = [  # (description, arrival, token_times)
        ("arrival=[0.0], token_times=[[0.5, 0.7, 0.9]]", [0.0], [[0.5, 0.7, 0.9]]),
        ("arrival=[0.0, 1.0], token_times=[[0.3, 0.4], [1.6, 1.7, 2.0]]", [0.0, 1.0],
         [[0.3, 0.4], [1.6, 1.7, 2.0]]),
        ("uneven gaps: arrival=[0.0], token_times=[[1.0, 1.1, 1.2, 2.0]]", [0.0], [[1.0, 1.1, 1.2, 2.0]]),
        ("a one-token output: arrival=[0.0, 0.0], token_times=[[0.4], [0.2, 0.5]]", [0.0, 0.0],
         [[0.4], [0.2, 0.5]]),
        (f"five requests, arrival={arrivals}, token_times={times}", arrivals, times),
    ]

    def close(a, b):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)

    for description, arrival, token_times in cases:
        want = reference(arrival, token_times)
        got, problem = call_learner(lambda: latency_metrics(list(arrival), [list(t) for t in token_times]),
                                    description)
        if problem:
            return verdict(name, problem)
        try:
            pairs = [(float(ttft), None if itl is None else float(itl)) for ttft, itl in got]
        except (TypeError, ValueError):
            return verdict(name, f"for {description} it returned {got!r}; expected a list of (ttft, "
                                 f"mean_itl) pairs, one per request")
        if len(pairs) != len(want):
            return verdict(name, f"for {description} it returned {len(pairs)} pairs for {len(want)} requests")
        for i, ((ttft, itl), (w_ttft, w_itl), t0, ts) in enumerate(zip(pairs, want, arrival, token_times)):
            if not close(ttft, w_ttft):
                hint = (" (TTFT counts from the request's own arrival, not from time 0)"
                        if close(ttft, ts[0]) else " (TTFT = the first token's time - arrival)")
                return verdict(name, f"for {description}, request {i}'s TTFT was {ttft:.6g}, "
                                     f"expected {w_ttft:.6g}{hint}")
            if w_itl is None:
                if itl is not None:
                    return verdict(name, f"for {description}, request {i} has one token and its ITL was "
                                         f"{itl:.6g}; expected None (there is no gap between tokens, and a 0 "
                                         f"would pull the average ITL down)")
                continue
            if itl is None or not close(itl, w_itl):
                if itl is not None and close(itl, (ts[-1] - t0) / len(ts)):
                    hint = " (the wait for the first token is TTFT, not a gap between tokens)"
                elif itl is not None and close(itl, (ts[-1] - ts[0]) / len(ts)):
                    hint = f" ({len(ts)} tokens have {len(ts) - 1} gaps between them)"
                else:
                    hint = " (the mean of the gaps between consecutive tokens)"
                got_itl = "None" if itl is None else f"{itl:.6g}"
                return verdict(name, f"for {description}, request {i}'s mean ITL was {got_itl}, "
                                     f"expected {w_itl:.6g}{hint}")
    return verdict(name, None)


def _scheduler_scenarios():
    """check_scheduler's workloads: (what it tests, pool and scheduler settings, requests as
    (prompt_len, max_tokens, step it arrives at)). Hand-written ones first, each aimed at one rule,
    then random ones."""
    import random

    def cfg(num_blocks=64, block_size=4, max_num_seqs=4, budget=64, watermark=0.0, prefix=False):
        return dict(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=budget, watermark=watermark, enable_prefix_caching=prefix)

    fixed = [
        ("a 40-token prompt with a budget of 16 (chunked prefill: 16, 16, 8, then one token per decode)",
         cfg(budget=16), [(40, 3, 0)]),
        ("prompts of 6 and 9 tokens with a budget of 10 (the running first, then the waiting get what is "
         "left of the budget)", cfg(budget=10), [(6, 3, 0), (9, 3, 0)]),
        ("three 4-token prompts with max_num_seqs=2 (at most 2 run at once)", cfg(max_num_seqs=2),
         [(4, 4, 0), (4, 4, 0), (4, 4, 0)]),
        ("a 20-token request running in 8 blocks of 4, then a 20-token and a 4-token prompt (FCFS: the head "
         "does not fit yet, so nobody behind it starts)", cfg(num_blocks=8),
         [(20, 6, 0), (20, 2, 1), (4, 2, 1)]),
        ("a 20-token prompt in a pool of 4 blocks of 4, then a 4-token one (the first can never fit: it "
         "ends with an error and the queue moves on)", cfg(num_blocks=4), [(20, 2, 0), (4, 2, 0)]),
        ("8 requests of 8 tokens in 8 blocks of 8 (no block free: preempt the newest running request, "
         "which preempts itself when it is the newest, and goes back to the front of the queue)",
         cfg(num_blocks=8, block_size=8, max_num_seqs=8), [(8, 12, 0)] * 8),
        ("two requests in 6 blocks of 4 with a watermark of 0.34 (2 blocks kept free when admitting beside "
         "running requests)", cfg(num_blocks=6, watermark=0.34), [(4, 6, 0), (8, 2, 1)]),
        ("three prompts sharing 8 prefix tokens, prefix caching on (a cached prefix is not recomputed: "
         "schedule num_tokens minus the cached tokens)", cfg(prefix=True),
         [(12, 2, 0), (11, 2, 2), (13, 2, 4)]),
    ]
    rng = random.Random(11)
    randomised = []
    for _ in range(6):
        block_size = rng.choice([2, 4, 8])
        requests = [(rng.randint(1, 24), rng.randint(1, 10), rng.randint(0, 12))
                    for _ in range(rng.randint(4, 9))]
        need = max(-(-(p + m) // block_size) for p, m, _ in requests)
        settings = cfg(num_blocks=need + rng.randint(0, 12), block_size=block_size,
                       max_num_seqs=rng.randint(1, 5), budget=rng.choice([4, 8, 16, 64]),
                       prefix=rng.random() < 0.5)
        randomised.append(("a random workload", settings, requests))
    return fixed + randomised


def _run_scheduler(scheduler_cls, settings: dict, requests: list, prefix_tokens: list[int]):
    """Drive a scheduler without a model, step by step (what the engine does around schedule(): update,
    a token appended to each request whose tokens are all computed, finish at max_tokens). Yields
    (step, what the step scheduled, the scheduler) after each step."""
    from radarlab.engine import Request, RequestStatus, SamplingParams
    from radarlab.kvcache.kv_cache_manager import KVCacheManager

    manager = KVCacheManager(settings["num_blocks"], settings["block_size"],
                             settings["enable_prefix_caching"])
    scheduler = scheduler_cls(manager, settings["max_num_seqs"], settings["max_num_batched_tokens"], 4096,
                              settings["watermark"])
    pending = sorted(enumerate(requests), key=lambda r: r[1][2])
    for step in range(400):
        while pending and pending[0][1][2] <= step:
            i, (prompt_len, max_tokens, _) = pending.pop(0)
            prompt = (prefix_tokens + [100 + 10 * i + j for j in range(prompt_len)])[:prompt_len] \
                if settings["enable_prefix_caching"] else [100 + 10 * i + j for j in range(prompt_len)]
            scheduler.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens)))
        if not scheduler.has_unfinished_requests():
            if not pending:
                return
            continue
        out = scheduler.schedule()
        yield step, out, scheduler
        scheduler.update(out)
        for request in out.requests:
            if request.num_computed_tokens == request.num_tokens:
                request.append_token_ids([7 + step % 50])
                if request.num_output_tokens >= request.params.max_tokens:
                    scheduler.finish(request, RequestStatus.FINISHED_LENGTH)


def _step_summary(out, scheduler) -> dict:
    return {
        "scheduled (request: tokens from position)": [
            f"{r.request_id}: {n} from {c}" for r, c, n in zip(out.requests, out.num_computed_tokens,
                                                             out.num_scheduled_tokens)],
        "block ids": [list(b) for b in out.block_ids],
        "preempted": [r.request_id for r in out.preempted],
        "errored": [r.request_id for r in out.errored],
        "waiting afterwards": [r.request_id for r in scheduler.waiting],
        "running afterwards": [r.request_id for r in scheduler.running],
    }


def check_scheduler(scheduler_cls) -> bool:
    """Check a learner's Scheduler subclass (its schedule(): token budget, chunked prefill, FCFS
    admission, preemption by recompute) against radarlab's Scheduler.

    Workloads run without a model on both, step by step; every step's scheduled requests, token
    counts, block ids, preemptions and errors, and the queues afterwards, must be the same."""
    from itertools import zip_longest

    from radarlab.engine import Scheduler

    name = "scheduler"
    prefix = [900 + j for j in range(8)]
    for what, settings, requests in _scheduler_scenarios():
        where = (f"{what}; {settings['num_blocks']} blocks of {settings['block_size']}, max_num_seqs="
                 f"{settings['max_num_seqs']}, budget {settings['max_num_batched_tokens']}")
        if what == "a random workload":
            where += f", requests (prompt, max_tokens, arrival step) {requests}"
        mine = _run_scheduler(scheduler_cls, settings, requests, prefix)
        ref = _run_scheduler(Scheduler, settings, requests, prefix)
        while True:
            want = next(ref, None)
            try:
                got = next(mine, None)
            except NotImplementedError:
                return verdict(name, "schedule() is not written yet (it raises NotImplementedError)")
            except Exception as err:  # a learner's bug should read as a counterexample, not a traceback
                step = "" if want is None else f" at step {want[0]}"
                return verdict(name, f"for {where}{step} it raised {type(err).__name__}: {err}")
            if want is None and got is None:
                break
            if want is None or got is None:
                return verdict(name, f"for {where}: {'your' if got else 'the reference'} scheduler still had "
                                     f"requests to run after the other finished")
            want_summary, got_summary = _step_summary(want[1], want[2]), _step_summary(got[1], got[2])
            for key, (w, g) in zip(want_summary, zip_longest(want_summary.values(), got_summary.values())):
                if w != g:
                    return verdict(name, f"for {where}: at step {want[0]}, {key} {g}, expected {w}")
    return verdict(name, None)
