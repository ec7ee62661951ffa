"""Scheduler, sampling parameters and sampler, without a model: the scheduler's decisions are driven
by hand (update after each step, a fake token appended when a request's tokens are all computed)."""
from __future__ import annotations

import pytest
import torch

from radarlab.engine import Request, RequestStatus, SamplingParams, Scheduler
from radarlab.kvcache.kv_cache_manager import KVCacheManager
from radarlab.sample.sampler import apply_top_k_top_p, sample


def make(num_blocks=16, block_size=4, **kw):
    manager = KVCacheManager(num_blocks, block_size)
    return manager, Scheduler(manager, **kw)


def req(rid, n, start=0, max_tokens=100):
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens))


def run_step(sched, token=1):
    """One schedule + update; requests whose tokens are all computed get `token` appended."""
    out = sched.schedule()
    sched.update(out)
    for r in out.requests:
        if r.num_computed_tokens == r.num_tokens:
            r.append_token_ids([token])
    return out


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_p": -0.1}, "top_p"),
    ({"temperature": -0.5}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"n": 0}, "n"), ({"top_k": -2}, "top_k"), ({"stop_token_ids": (-1,)}, "stop_token_ids"),
])
def test_sampling_params_reject_bad_fields(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_defaults_are_greedy():
    p = SamplingParams(stop_token_ids=[3, 4])
    assert p.greedy and p.stop_token_ids == (3, 4)


def test_chunked_prefill_respects_the_token_budget():
    manager, sched = make(max_num_batched_tokens=16)
    sched.add_request(req("a", 40))
    chunks = [run_step(sched).num_scheduled_tokens for _ in range(4)]
    assert chunks == [[16], [16], [8], [1]]  # three prefill chunks, then a decode


def test_running_first_then_admission_fills_the_budget():
    manager, sched = make(num_blocks=32, max_num_batched_tokens=10)
    sched.add_request(req("a", 6))
    sched.add_request(req("b", 9, start=50))
    out = run_step(sched)
    assert [r.request_id for r in out.requests] == ["a", "b"] and out.num_scheduled_tokens == [6, 4]
    out = run_step(sched)
    assert out.num_scheduled_tokens == [1, 5]  # a decodes, b finishes its prompt


def test_max_num_seqs_caps_the_running_batch():
    manager, sched = make(num_blocks=64, max_num_seqs=2)
    for i in range(4):
        sched.add_request(req(i, 3, start=10 * i))
    out = run_step(sched)
    assert [r.request_id for r in out.requests] == [0, 1] and len(sched.waiting) == 2


def test_fcfs_head_of_queue_is_not_overtaken():
    manager, sched = make(num_blocks=4, block_size=4)
    sched.add_request(req("big", 12))  # 3 blocks
    run_step(sched)
    sched.add_request(req("also_big", 8, start=40))  # needs 2, only 1 free
    sched.add_request(req("small", 2, start=80))  # would fit, must wait behind also_big
    out = run_step(sched)
    assert [r.request_id for r in out.requests] == ["big"]
    assert [r.request_id for r in sched.waiting] == ["also_big", "small"]


def test_preemption_frees_the_newest_and_requeues_it_ahead_of_later_arrivals():
    manager, sched = make(num_blocks=4, block_size=4)
    sched.add_request(req("old", 8))
    sched.add_request(req("new", 8, start=40))
    run_step(sched)  # both prefilled: 4 blocks used, both need a fifth block to decode
    sched.add_request(req("later", 4, start=80))  # arrives after both, waits: the pool is full
    out = run_step(sched)
    assert [r.request_id for r in out.preempted] == ["new"]
    assert [r.request_id for r in out.requests] == ["old"] and out.num_scheduled_tokens == [1]
    new = sched.requests["new"]
    assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert [r.request_id for r in sched.waiting] == ["new", "later"] and "new" not in manager
    assert manager.num_free_blocks == 1  # 2 freed by new, 1 taken by old


def test_a_lone_request_that_outgrows_the_pool_errors_instead_of_hanging():
    manager, sched = make(num_blocks=2, block_size=4)
    sched.add_request(req("a", 8))
    run_step(sched)
    out = sched.schedule()  # needs a third block: preempts itself, then can never be readmitted
    assert [r.request_id for r in out.errored] == ["a"] and out.requests == []
    assert sched.requests == {} and not sched.has_unfinished_requests()
    assert manager.num_free_blocks == 2
    assert "whole pool" in out.errored[0].error


def test_too_long_and_never_fitting_prompts_error_and_others_run():
    manager, sched = make(num_blocks=4, block_size=4, max_model_len=20)
    sched.add_request(req("long", 21))
    sched.add_request(req("huge", 17))  # 5 blocks > pool of 4
    sched.add_request(req("ok", 5, start=60))
    out = run_step(sched)
    assert {r.request_id: r.status for r in out.errored} == {"long": RequestStatus.FINISHED_ERROR,
                                                             "huge": RequestStatus.FINISHED_ERROR}
    assert "max_model_len" in sched_error(out, "long") and "whole pool" in sched_error(out, "huge")
    assert [r.request_id for r in out.requests] == ["ok"]


def sched_error(out, rid):
    return next(r.error for r in out.errored if r.request_id == rid)


def test_a_chunked_prefill_holds_blocks_only_for_the_chunks_done():
    """vLLM v1's allocate_slots: blocks for the tokens scheduled this step, not the whole prompt."""
    manager, sched = make(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    sched.add_request(req("a", 20))
    for step in range(1, 4):
        run_step(sched)
        computed = sched.requests["a"].num_computed_tokens
        assert computed == min(8 * step, 20)
        assert len(manager.get_block_table("a")) == -(-computed // 4)  # never a block ahead
        assert manager.num_slots("a") == computed


def test_admission_needs_room_for_the_whole_prompt():
    """scheduler_reserve_full_isl: a long prompt is not admitted for its first chunk alone."""
    manager, sched = make(num_blocks=6, block_size=4, max_num_batched_tokens=4)
    sched.add_request(req("a", 8))
    run_step(sched)  # one chunk of 4: a holds 1 block of the 2 it will need
    run_step(sched)
    assert manager.num_free_blocks == 4
    sched.add_request(req("b", 20, start=50))  # needs 5 blocks; 4 are free, though its first chunk needs 1
    out = run_step(sched)
    assert [r.request_id for r in out.requests] == ["a"] and [r.request_id for r in sched.waiting] == ["b"]


def test_a_prefix_hit_mid_prefill_finds_only_computed_blocks():
    """Blocks are registered in the prefix cache only when the chunk that fills them is scheduled,
    so a request arriving while another prefills the same prefix hits exactly the blocks with K/V."""
    manager, sched = make(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    sched.add_request(req("a", 20))
    run_step(sched)  # 8 of 20 computed: blocks 0, 1 hold K/V and are cached; nothing else is
    assert manager.block_pool.num_cached_blocks == 2
    sched.add_request(req("b", 20))
    out = run_step(sched)  # a's next chunk of 8 uses the whole budget: b waits
    assert [r.request_id for r in out.requests] == ["a"]
    a_computed = sched.requests["a"].num_computed_tokens
    out = run_step(sched)
    while "b" not in [r.request_id for r in out.requests]:
        a_computed = sched.requests["a"].num_computed_tokens
        out = run_step(sched)
    # b is admitted beside a's last chunk, and hits a's four full blocks: all computed before this step
    assert a_computed >= 16 and out.num_computed_tokens[-1] == 16


def test_abort_mid_prefill_uncaches_blocks_that_were_never_computed():
    manager, sched = make(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    sched.add_request(req("a", 20))
    run_step(sched)  # 8 computed: blocks 0, 1 hold K/V and are cached
    sched.schedule()  # the next chunk is reserved (blocks 2 and 3 registered) but never computed
    assert manager.block_pool.num_cached_blocks == 4
    sched.abort("a")
    assert manager.num_free_blocks == 32 and "a" not in manager
    assert manager.block_pool.num_cached_blocks == 2  # only the computed ones stay findable
    assert sched.abort("a") is None


def test_abort_waiting_request():
    manager, sched = make(num_blocks=4, block_size=4)
    sched.add_request(req("a", 16))
    sched.add_request(req("b", 4, start=40))
    run_step(sched)
    assert sched.abort("b").status is RequestStatus.FINISHED_ABORTED
    assert list(sched.waiting) == []


def test_duplicate_request_id_raises():
    manager, sched = make()
    sched.add_request(req("a", 3))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(req("a", 3))


def test_scheduler_rejects_bad_limits():
    manager = KVCacheManager(4, 4)
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
        with pytest.raises(ValueError, match=name):
            Scheduler(manager, **{name: 0})


# --- sampler -----------------------------------------------------------------------------------
def test_sampler_greedy_and_degenerate_truncations_pick_the_argmax():
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))
    argmax = logits.argmax(-1).tolist()
    for params in (SamplingParams(), SamplingParams(temperature=1.0, top_k=1),
                   SamplingParams(temperature=1.0, top_p=1e-6)):
        gens = [torch.Generator().manual_seed(i) for i in range(5)]
        assert sample(logits, [params] * 5, gens) == argmax


def test_top_k_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert torch.isfinite(apply_top_k_top_p(logits, 2, 1.0)).tolist() == [True, True, False, False]
    assert torch.isfinite(apply_top_k_top_p(logits, 0, 0.8)).tolist() == [True, True, False, False]
    assert torch.isfinite(apply_top_k_top_p(logits, 0, 0.81)).tolist() == [True, True, True, False]


def test_sampler_rows_are_independent_of_the_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 30, generator=g)
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9)
    batch = sample(logits, [params] * 4, [torch.Generator().manual_seed(s) for s in range(4)])
    alone = [sample(logits[i:i + 1], [params], [torch.Generator().manual_seed(i)])[0] for i in range(4)]
    assert batch == alone


@pytest.mark.parametrize("watermark, admitted", [(0.0, True), (0.25, False)])
def test_watermark_keeps_blocks_free_for_the_running(watermark, admitted):
    """vLLM's watermark: a new request is admitted only if watermark * num_blocks blocks stay free
    for the requests already running (here 2 of 8)."""
    manager, sched = make(num_blocks=8, block_size=4, watermark=watermark)
    sched.add_request(req("a", 8))
    run_step(sched)  # a holds 2 blocks, 6 are free
    sched.add_request(req("b", 20, start=50))  # 5 blocks: fits, but not with 2 kept free
    out = run_step(sched)
    assert ("b" in [r.request_id for r in out.requests]) is admitted


def test_watermark_does_not_apply_to_a_lone_request():
    manager, sched = make(num_blocks=8, block_size=4, watermark=0.5)
    sched.add_request(req("a", 30))  # 8 blocks: the whole pool, nothing else runs
    out = run_step(sched)
    assert [r.request_id for r in out.requests] == ["a"]


@pytest.mark.parametrize("bad", [-0.1, 1.0, float("nan"), "0.1"])
def test_watermark_must_be_a_fraction(bad):
    with pytest.raises(ValueError, match="watermark"):
        make(watermark=bad)


def add_drafts(request, drafts):
    """What the engine does before scheduling a decoding request: drafts go beside its tokens."""
    request.spec_token_ids = list(drafts)


def test_drafts_count_in_the_budget_and_get_slots_and_those_past_it_are_dropped():
    manager, sched = make(max_num_batched_tokens=4)
    a = req("a", 4)
    sched.add_request(a)
    run_step(sched)  # prefill: a now holds 5 tokens, 4 computed
    add_drafts(a, [7, 8, 9, 10, 11])  # 1 + 5 tokens to compute, budget 4: two drafts go
    out = sched.schedule()
    assert out.num_scheduled_tokens == [4] and out.num_spec_tokens == [3]
    # never among the tokens
    assert a.spec_token_ids == [7, 8, 9] and a.num_tokens == 5 and a.num_tokens_with_spec == 8
    # nor hashed: with them, two blocks would be full
    assert len(a.block_hashes) == 5 // manager.block_size == 1
    assert manager.num_slots(a) == 8 and len(manager.get_block_table(a)) == 2  # the drafts' slots, reserved
    free = manager.num_free_blocks
    sched.update(out, [3])  # all three rejected: their positions count as not computed, their slots stay
    assert a.num_tokens == a.num_computed_tokens == 5 and a.spec_token_ids == []
    assert manager.num_slots(a) == 8 and manager.num_free_blocks == free  # vLLM keeps the blocks too
    a.append_token_ids([42])  # the target's own token takes position 5, in a slot already reserved
    out = sched.schedule()
    assert out.num_scheduled_tokens == [1] and manager.num_slots(a) == 8 and manager.num_free_blocks == free
    with pytest.raises(ValueError, match="rejected of"):
        sched.update(out, [1])  # no drafts were scheduled: nothing to reject


def test_drafts_of_preempted_and_unscheduled_requests_are_dropped():
    manager, sched = make(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a, b = req("a", 7), req("b", 7, start=20)
    sched.add_request(a)
    sched.add_request(b)
    run_step(sched)  # both prefilled: 8 tokens each, 2 blocks each, pool full
    add_drafts(a, [1, 2])
    add_drafts(b, [3, 4])
    out = sched.schedule()  # a's drafts need a third block: b, the newest, is preempted
    assert out.preempted == [b] and b.spec_token_ids == [] and b.num_tokens == 8
    assert out.requests == [a] and out.num_spec_tokens == [2]
    sched.update(out, [2])
    _, sched2 = make(max_num_batched_tokens=2)
    c, d = req("c", 1), req("d", 1, start=9)
    sched2.add_request(c)
    sched2.add_request(d)
    run_step(sched2)  # both prefilled, now decoding
    add_drafts(c, [5])
    add_drafts(d, [6])
    out = sched2.schedule()  # c's token and draft use the whole budget: d waits, without its draft
    assert out.requests == [c] and out.num_spec_tokens == [1]
    assert d.spec_token_ids == [] and d.num_tokens == 2
