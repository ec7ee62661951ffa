"""The engine against the contiguous greedy reference (any batch size, arrival order, pool size),
seeded sampling independent of the batch, bad input, and a long random run with aborts."""
from __future__ import annotations

import random

import pytest

from radarlab.engine import Engine, RequestStatus, SamplingParams
from radarlab.models.generate import greedy_generate

VOCAB = 128  # the vocabulary of conftest's tiny model


def random_prompts(n, lo=1, hi=40, seed=0, shared_prefix=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(scope="module")
def workload(tiny):
    prompts = random_prompts(8, seed=1) + random_prompts(4, seed=2, shared_prefix=23)
    return prompts, greedy_generate(tiny, prompts, 10)


@pytest.mark.parametrize("batch", [1, 3, 8, 12])
# roomy, chunked, preempting
@pytest.mark.parametrize("num_blocks, budget", [(128, 512), (128, 16), (20, 24)])
def test_greedy_equals_reference(tiny, workload, batch, num_blocks, budget):
    prompts, ref = workload
    engine = Engine(tiny, num_blocks=num_blocks, block_size=4, max_num_seqs=batch,
                    max_num_batched_tokens=budget)
    outs = engine.generate(prompts, SamplingParams(max_tokens=10))
    assert [o.output_token_ids for o in outs] == ref
    assert all(o.status is RequestStatus.FINISHED_LENGTH for o in outs)
    assert engine.manager.num_free_blocks == num_blocks
    if num_blocks == 20 and batch > 1:
        assert engine.scheduler.num_preemptions > 0  # the small pool really did preempt


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_equals_reference_with_staggered_arrivals(tiny, workload, seed):
    """Requests arrive in a random order, a few at a time, while others are mid-generation."""
    prompts, ref = workload
    rng = random.Random(seed)
    order = list(range(len(prompts)))
    rng.shuffle(order)
    engine = Engine(tiny, num_blocks=20, block_size=4, max_num_seqs=5, max_num_batched_tokens=20)
    rid_to_prompt, done = {}, {}
    pending = list(order)
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 2)):
            if pending:
                i = pending.pop(0)
                rid_to_prompt[engine.add_request(prompts[i], SamplingParams(max_tokens=10))] = i
        for out in engine.step():
            if out.finished:
                done[rid_to_prompt[out.request_id]] = out.output_token_ids
    assert [done[i] for i in range(len(prompts))] == ref
    assert engine.manager.num_free_blocks == 20


def test_prefix_cache_is_used_and_outputs_unchanged(tiny):
    prompts = random_prompts(6, lo=3, hi=9, seed=5, shared_prefix=32)
    ref = greedy_generate(tiny, prompts, 6)
    engine = Engine(tiny, num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    assert [o.output_token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=6))] == ref
    assert engine.manager.prefix_cache_stats.hit_rate > 0.5


def test_the_engine_runs_on_the_block_pool_it_is_given(tiny):
    """Engine(block_pool_cls=...) is notebook 03's seam: the manager's pool is made by that class, and
    the same calls give the same blocks, tokens and hits as radarlab's BlockPool."""
    from radarlab.kvcache.block_pool import BlockPool

    class CountingPool(BlockPool):
        def __init__(self, *args):
            super().__init__(*args)
            self.calls = 0

        def allocate_many(self, n):
            self.calls += 1
            return super().allocate_many(n)

    prompts = random_prompts(6, lo=3, hi=9, seed=5, shared_prefix=32)
    runs = []
    for cls in (BlockPool, CountingPool):
        engine = Engine(tiny, num_blocks=24, block_size=4, max_num_seqs=2, block_pool_cls=cls)
        out = [o.output_token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=6))]
        stats = engine.manager.prefix_cache_stats
        runs.append((out, stats.queries, stats.hits))
    assert type(engine.manager.block_pool) is CountingPool and engine.manager.block_pool.calls > 6
    assert runs[0] == runs[1] and runs[0][2] > 0


def test_the_engine_runs_the_scheduler_it_is_given(tiny, workload):
    """Engine(scheduler_cls=...) is notebook 05's seam: made from the engine's own settings, and its
    schedule() is what every step runs."""
    from radarlab.engine import Scheduler

    class CountingScheduler(Scheduler):
        steps = 0

        def schedule(self):
            CountingScheduler.steps += 1
            return super().schedule()

    prompts, ref = workload
    engine = Engine(tiny, num_blocks=20, block_size=4, max_num_seqs=3, max_num_batched_tokens=16,
                    scheduler_cls=CountingScheduler)
    assert [o.output_token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=10))] == ref
    sched = engine.scheduler
    assert type(sched) is CountingScheduler and CountingScheduler.steps == engine.num_steps > 0
    assert (sched.max_num_seqs, sched.max_num_batched_tokens, sched.manager) == (3, 16, engine.manager)


def test_stream_yields_the_generated_tokens_in_order(tiny, workload):
    prompts, ref = workload
    engine = Engine(tiny, num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    got: dict = {}
    for rid, token in engine.stream(prompts[:5], SamplingParams(max_tokens=10)):
        got.setdefault(rid, []).append(token)
    assert [got[i] for i in range(5)] == ref[:5]


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(tiny, workload):
    prompts, _ = workload
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.95, max_tokens=8, seed=100 + i)
              for i in range(len(prompts))]
    alone = [Engine(tiny, num_blocks=32, block_size=4).generate([p], sp)[0].output_token_ids
             for p, sp in zip(prompts[:4], params[:4])]
    engine = Engine(tiny, num_blocks=14, block_size=4, max_num_seqs=6, max_num_batched_tokens=24)
    batched = [o.output_token_ids for o in engine.generate(prompts, params)]
    assert batched[:4] == alone
    assert engine.scheduler.num_preemptions > 0  # recompute after preemption keeps the generator's state
    greedy = greedy_generate(tiny, prompts[:4], 8)
    assert alone != greedy  # it did sample


def test_stop_tokens_and_eos(tiny, workload):
    prompts, ref = workload
    stop = ref[0][3]
    first = ref[0].index(stop)
    engine = Engine(tiny, num_blocks=32, block_size=4, eos_token_id=stop)
    out = engine.generate([prompts[0]], SamplingParams(max_tokens=10))[0]
    assert out.output_token_ids == ref[0][:first + 1] and out.status is RequestStatus.FINISHED_STOPPED
    out = engine.generate([prompts[0]], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert out.output_token_ids == ref[0]
    engine = Engine(tiny, num_blocks=32, block_size=4)
    out = engine.generate([prompts[0]], SamplingParams(max_tokens=10, stop_token_ids=[stop]))[0]
    assert out.output_token_ids == ref[0][:first + 1] and out.status is RequestStatus.FINISHED_STOPPED


def test_max_model_len_caps_generation(tiny):
    engine = Engine(tiny, num_blocks=32, block_size=4, max_model_len=12)
    out = engine.generate([list(range(10))], SamplingParams(max_tokens=50))[0]
    assert len(out.output_token_ids) == 2 and out.status is RequestStatus.FINISHED_LENGTH


@pytest.mark.parametrize("call, match", [
    (lambda e: e.add_request([]), "empty"),
    (lambda e: e.add_request([1, VOCAB]), "vocabulary"),
    (lambda e: e.add_request([1, -1]), ">= 0"),
    (lambda e: e.generate([[1, 2], []]), "prompt 1 is empty"),
    (lambda e: e.generate([]), "prompts is empty"),
    (lambda e: e.generate([[1]], [SamplingParams(), SamplingParams()]), "2 SamplingParams for 1"),
    (lambda e: e.add_request([1], params="greedy"), "SamplingParams"),
])
def test_bad_input_raises(tiny, call, match):
    engine = Engine(tiny, num_blocks=8, block_size=4)
    with pytest.raises(ValueError, match=match):
        call(engine)
    assert not engine.has_unfinished_requests()


def test_bad_engine_settings_raise(tiny):
    with pytest.raises(ValueError, match="max_model_len"):
        Engine(tiny, num_blocks=8, max_model_len=10_000)
    with pytest.raises(ValueError, match="num_blocks"):
        Engine(tiny, num_blocks=0)
    with pytest.raises(ValueError, match="n=3 samples need 3 sequence slots, more than max_num_seqs=2"):
        Engine(tiny, num_blocks=8, max_num_seqs=2).add_request([1], SamplingParams(n=3))


# --- parallel sampling (n > 1): one prompt, n samples sharing its blocks ----------------------------
def test_parallel_greedy_samples_all_equal_the_reference(tiny, workload):
    prompts, ref = workload
    engine = Engine(tiny, num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    outs = engine.generate(prompts[:2], SamplingParams(max_tokens=10, n=3))
    assert [o.completions for o in outs] == [[ref[0]] * 3, [ref[1]] * 3]
    assert outs[0].output_token_ids == ref[0]
    assert engine.manager.num_free_blocks == 64


@pytest.mark.parametrize("num_blocks", [64, 13])  # 13: samples get preempted and recomputed
def test_parallel_samples_equal_independent_seeded_requests(tiny, workload, num_blocks):
    """Sample i of an n-sample request draws from seed + i: it must equal a lone request with that
    seed. Any corruption of the shared (copy-on-write) blocks would change its logits."""
    prompts, _ = workload
    prompt = prompts[2]  # not a multiple of the block size, so the last prompt block is shared and copied
    assert len(prompt) % 4
    sp = dict(temperature=1.0, top_k=40, max_tokens=12)
    alone = [Engine(tiny, num_blocks=32, block_size=4).generate([prompt], SamplingParams(seed=7 + i, **sp))[0]
             .output_token_ids for i in range(4)]
    assert len({tuple(a) for a in alone}) > 1  # the samples differ
    engine = Engine(tiny, num_blocks=num_blocks, block_size=4, max_num_seqs=6, max_num_batched_tokens=64)
    other = SamplingParams(max_tokens=12)
    outs = engine.generate([prompt, prompts[3]], [SamplingParams(seed=7, n=4, **sp), other])
    assert outs[0].completions == alone
    assert outs[1].completions == [greedy_generate(tiny, [prompts[3]], 12)[0]]
    assert engine.manager.num_free_blocks == num_blocks
    if num_blocks == 13:
        assert engine.scheduler.num_preemptions > 0


def test_parallel_samples_share_the_prompt_blocks_and_copy_on_write(tiny):
    prompt = list(range(1, 11))  # 10 tokens: blocks of 4 -> 2 full + 1 partial
    engine = Engine(tiny, num_blocks=32, block_size=4, max_num_seqs=4, enable_prefix_caching=False)
    engine.add_request(prompt, SamplingParams(n=3, max_tokens=4))
    outs = engine.step()  # the prompt, computed once, and the first token of all 3 samples
    assert sorted(str(o.request_id) for o in outs) == ["(0, 1)", "(0, 2)", "0"]
    assert engine.manager.num_free_blocks == 32 - 3  # 3 samples, still one copy of the prompt
    engine.step()  # first decode: each sample writes into the shared partial block
    pairs = engine.last_scheduled.copy_pairs
    # two copies of it; the last owner keeps it
    assert len(pairs) == 2 and len({src for src, _ in pairs}) == 1
    assert engine.manager.num_free_blocks == 32 - 5


def test_abort_stops_every_sample(tiny):
    engine = Engine(tiny, num_blocks=32, block_size=4, max_num_seqs=4)
    rid = engine.add_request(list(range(1, 8)), SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=0))
    engine.step()
    engine.step()
    assert engine.abort(rid) and not engine.abort(rid)
    assert not engine.has_unfinished_requests() and engine.manager.num_free_blocks == 32


def test_a_pool_that_cannot_hold_max_model_len_is_refused(tiny):
    refused = r"max_model_len=25 does not fit the KV cache: its 6 blocks of 4 hold 24 tokens"
    with pytest.raises(ValueError, match=refused):
        Engine(tiny, num_blocks=6, block_size=4, max_model_len=25)
    assert Engine(tiny, num_blocks=6, block_size=4, max_model_len=24).max_model_len == 24


def test_oversize_prompts_fail_alone(tiny, workload):
    prompts, ref = workload
    engine = Engine(tiny, num_blocks=16, block_size=4, max_model_len=48)
    outs = engine.generate([prompts[0], list(range(49)), prompts[1]], SamplingParams(max_tokens=10))
    assert outs[1].status is RequestStatus.FINISHED_ERROR and "max_model_len" in outs[1].error
    assert outs[1].output_token_ids == []
    assert [outs[0].output_token_ids, outs[2].output_token_ids] == [ref[0], ref[1]]
    short = random_prompts(2, lo=3, hi=8, seed=9)
    short_ref = greedy_generate(tiny, short, 10)
    small = Engine(tiny, num_blocks=6, block_size=4)  # 24 slots: max_model_len 24, so 25 tokens never fit
    assert small.max_model_len == 24
    outs = small.generate([short[0], list(range(25)), short[1]], SamplingParams(max_tokens=10))
    assert outs[1].status is RequestStatus.FINISHED_ERROR and "max_model_len=24" in outs[1].error
    assert [outs[0].output_token_ids, outs[2].output_token_ids] == short_ref
    assert small.manager.num_free_blocks == 6


def test_abort_frees_blocks_and_others_continue(tiny, workload):
    prompts, ref = workload
    engine = Engine(tiny, num_blocks=64, block_size=4, max_num_batched_tokens=16)
    ids = [engine.add_request(p, SamplingParams(max_tokens=10)) for p in prompts[:3]]
    engine.step()
    engine.step()
    assert engine.abort(ids[1]) and not engine.abort(ids[1]) and not engine.abort("nope")
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != ids[1]
            if out.finished:
                done[out.request_id] = out.output_token_ids
    assert done == {ids[0]: ref[0], ids[2]: ref[2]}
    assert engine.manager.num_free_blocks == 64


@pytest.mark.slow
def test_500_random_requests_with_aborts_terminate_and_free_everything(tiny):
    rng = random.Random(0)
    engine = Engine(tiny, num_blocks=24, block_size=4, max_num_seqs=16, max_num_batched_tokens=48,
                    max_model_len=96)  # all the pool holds: an Engine refuses more
    live, finished, aborted, to_add = set(), set(), set(), 500
    steps = errors = 0
    while to_add or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 6)):
            if to_add:
                # some can never run
                n = rng.choice([rng.randint(1, 12), rng.randint(1, 12), rng.randint(60, 140)])
                params = SamplingParams(temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randint(1, 8),
                                        seed=rng.randrange(1000), n=rng.choice([1, 1, 1, 2, 3]))
                live.add(engine.add_request([rng.randrange(VOCAB) for _ in range(n)], params))
                to_add -= 1
        if live and rng.random() < 0.2:
            rid = rng.choice(sorted(live))
            if engine.abort(rid):  # False: it already ended with an error, reported by the next step
                live.discard(rid)
                aborted.add(rid)
        for out in engine.step():
            assert out.request_id not in aborted and out.parent_id not in aborted
            if out.parent_id is not None:  # a forked sample (n > 1); its parent is what we track
                continue
            if out.finished:
                live.discard(out.request_id)
                finished.add(out.request_id)
                errors += out.status is RequestStatus.FINISHED_ERROR
        steps += 1
        assert steps < 5000, "the engine did not terminate"
    assert not live and len(finished) + len(aborted) == 500
    assert engine.manager.num_free_blocks == 24 and engine.manager.block_tables == {}
    assert engine.scheduler.running == [] and not engine.scheduler.waiting
    assert errors > 0 and engine.scheduler.num_preemptions > 0 and aborted  # every path was taken


def test_course_model_batch_4_equals_greedy_generate(model, prompts):
    ps = prompts[:4]
    ref = greedy_generate(model, ps, 16)
    engine = Engine(model, num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=256)
    assert [o.output_token_ids for o in engine.generate(ps, SamplingParams(max_tokens=16))] == ref
    assert engine.manager.num_free_blocks == 64
