"""The model on the paged cache through the block manager: radarlab.models.paged_runner.

Most tests use a tiny random Llama (2 layers, GQA), so prefix hits, copy-on-write and chunked prefill
are checked on many block sizes in seconds; one test runs the course model. The reference is always
the contiguous path (greedy_generate), itself tested equal to transformers in test_llama.
"""
from __future__ import annotations

import pytest
import torch

from radarlab.kvcache.block_pool import NoFreeBlocks
from radarlab.kvcache.kv_cache_manager import KVCacheManager
from radarlab.kvcache.paged_cache import PagedKVCache
from radarlab.kvcache.sequence import Sequence
from radarlab.models.generate import greedy_generate
from radarlab.models.paged_runner import blocks_needed, paged_greedy_generate, paged_metadata, paged_step

PROMPTS = [list(range(1, 10)), list(range(1, 9)) + [40, 41], [5, 6], [7] * 8]  # shared prefix; short; aligned
NEW = 7


@pytest.fixture(scope="module")
def tiny(tiny_sharp):
    """Large weights: logits far apart, so greedy tokens depend on every K/V (conftest)."""
    return tiny_sharp


@pytest.fixture(scope="module")
def reference(tiny):
    return greedy_generate(tiny, PROMPTS, NEW)


def pool(model, num_blocks, block_size, prefix=True):
    return (KVCacheManager(num_blocks, block_size, prefix),
            PagedKVCache.for_model(model.config, num_blocks, block_size))


@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
@pytest.mark.parametrize("prefix", [True, False])
def test_greedy_equals_contiguous(tiny, reference, block_size, prefix):
    got = paged_greedy_generate(tiny, PROMPTS, NEW, block_size=block_size, enable_prefix_caching=prefix)
    assert got == reference


def test_same_batch_prefix_hit_is_used_and_correct(tiny, reference):
    """Prompt 1 hits the two full blocks prompt 0 registers in the same step; their K/V is written by
    prompt 0's tokens in each layer before prompt 1's queries read it."""
    manager, cache = pool(tiny, 40, 4)
    assert paged_greedy_generate(tiny, PROMPTS, NEW, manager=manager, cache=cache) == reference
    # prompt 1: blocks [1..4] and [5..8]; prompt 3 is all one token
    assert manager.prefix_cache_stats.hits == 8
    assert not manager.block_tables and manager.block_pool.num_used_blocks == 0  # every sequence freed


def test_second_call_hits_the_cache_and_recomputes_the_last_block(tiny, reference):
    manager, cache = pool(tiny, 40, 4)
    paged_greedy_generate(tiny, PROMPTS, NEW, manager=manager, cache=cache)
    before = manager.prefix_cache_stats.hits
    assert paged_greedy_generate(tiny, PROMPTS, NEW, manager=manager, cache=cache) == reference
    # 9 tokens: 2 blocks hit; 10: 2; 2: none; 8 (block-aligned): 1, since the block with the last token
    # is recomputed
    assert manager.prefix_cache_stats.hits - before == 4 * (2 + 2 + 0 + 1)


def test_evicted_blocks_are_recomputed_not_reused(tiny, reference):
    """A pool that just fits one request at a time: each call evicts the previous one's cached blocks."""
    manager, cache = pool(tiny, blocks_needed(PROMPTS[:1], NEW, 4), 4)
    for prompt, want in zip(PROMPTS, reference):
        assert paged_greedy_generate(tiny, [prompt], NEW, manager=manager, cache=cache) == [want]


def test_fork_then_copy_on_write_equals_two_separate_runs(tiny):
    """Parallel sampling: one prefill, a fork, two forced first tokens, then greedy continuations."""
    prompt, forced = PROMPTS[0], [3, 17]  # 9 tokens, block size 4: the fork shares a partly filled block
    manager, cache = pool(tiny, 12, 4)
    a, b = Sequence("a", prompt), Sequence("b", prompt)
    manager.allocate(a)
    paged_step(tiny, cache, manager, [a], [0])
    manager.fork(a, b)
    assert manager.get_block_table(a) == manager.get_block_table(b)
    a.append_token_ids([forced[0]])
    b.append_token_ids([forced[1]])
    copies = manager.allocate_slots(a, 1) + manager.allocate_slots(b, 1)
    assert len(copies) == 1 and copies[0][0] == manager.get_block_table(b)[-1]  # the first writer copies
    cache.copy_blocks(copies)
    for _ in range(NEW):
        logits = paged_step(tiny, cache, manager, [a, b], [s.num_tokens - 1 for s in (a, b)])
        for s, tok in zip((a, b), logits.argmax(-1).tolist()):
            s.append_token_ids([tok])
            cache.copy_blocks(manager.allocate_slots(s, 1))
    want = greedy_generate(tiny, [prompt + [forced[0]], prompt + [forced[1]]], NEW)
    assert [list(a.output_token_ids[1:]), list(b.output_token_ids[1:])] == want
    assert manager.get_block_table(a)[:2] == manager.get_block_table(b)[:2]  # the full blocks stay shared


def test_skipping_the_copy_corrupts_the_fork(tiny):
    """The test above can fail: without copy_blocks the private block lacks the prompt's K/V."""
    prompt = PROMPTS[0]
    manager, cache = pool(tiny, 12, 4)
    a, b = Sequence("a", prompt), Sequence("b", prompt)
    manager.allocate(a)
    paged_step(tiny, cache, manager, [a], [0])
    manager.fork(a, b)
    b.append_token_ids([3])
    assert manager.allocate_slots(b, 1)  # a copy is due, and we skip it
    logits = paged_step(tiny, cache, manager, [b], [len(prompt)])
    want = greedy_generate(tiny, [prompt + [3]], 1)[0]
    assert logits.argmax(-1).tolist() != want


@pytest.mark.parametrize("chunks", [[13], [9, 4], [1, 11, 1], [4, 4, 4, 1]])
def test_chunked_prefill_equals_one_prefill(tiny, chunks):
    """Slots are reserved chunk by chunk, as the scheduler does, and the logits equal one prefill's."""
    ids = torch.randint(0, 61, (13,), generator=torch.Generator().manual_seed(3)).tolist()
    manager, cache = pool(tiny, 8, 4, prefix=False)
    s = Sequence("s", ids)
    done = 0
    for n in chunks:
        if s in manager:
            manager.allocate_slots(s, n)
        else:
            manager.allocate(s, n)
        logits = paged_step(tiny, cache, manager, [s], [done], [n])
        done += n
        assert len(manager.get_block_table(s)) == -(-done // 4)  # blocks only for the chunks so far
    full = greedy_generate(tiny, [ids], 1)[0]
    assert logits.argmax(-1).tolist() == full
    manager2, cache2 = pool(tiny, 8, 4, prefix=False)
    s2 = Sequence("s", ids)
    manager2.allocate(s2)
    assert (paged_step(tiny, cache2, manager2, [s2], [0]) - logits).abs().max() < 1e-5


def test_metadata_fields():
    manager = KVCacheManager(8, 4, enable_prefix_caching=False)
    a, b = Sequence("a", list(range(6))), Sequence("b", [1])
    manager.allocate(a)
    manager.allocate(b)
    meta = paged_metadata(manager, [a, b], [4, 0], [2, 1])
    assert meta.query_start_loc.tolist() == [0, 2, 3] and meta.seq_lens.tolist() == [6, 1]
    assert meta.slot_mapping.tolist() == [4, 5, 8]  # a: block 1 offsets 0, 1; b: block 2 offset 0
    assert meta.block_tables.tolist() == [[0, 1], [2, -1]]
    assert meta.positions.tolist() == [4, 5, 0]
    assert meta.checked_for is None  # not yet validated against any pool


def test_bad_input(tiny):
    manager, cache = pool(tiny, 8, 4)
    a = Sequence("a", [1, 2, 3])
    manager.allocate(a)
    with pytest.raises(ValueError, match="differ in length"):
        paged_metadata(manager, [a], [0, 0], [3])
    with pytest.raises(ValueError, match="only 3 have slots"):
        paged_metadata(manager, [a], [1], [3])
    with pytest.raises(ValueError, match="num_scheduled_tokens must be >= 1"):
        paged_metadata(manager, [a], [3], [0])
    with pytest.raises(ValueError, match="seqs is empty"):
        paged_metadata(manager, [], [], [])
    with pytest.raises(KeyError, match="'nope'"):
        paged_metadata(manager, [Sequence("nope", [1])], [0], [1])
    with pytest.raises(ValueError, match="both manager and cache"):
        paged_greedy_generate(tiny, [[1]], 1, manager=manager)
    with pytest.raises(ValueError, match="different pools"):
        other = PagedKVCache.for_model(tiny.config, 8, 2)
        paged_greedy_generate(tiny, [[1]], 1, manager=manager, cache=other)
    with pytest.raises(ValueError, match="distinct ids"):
        paged_greedy_generate(tiny, [[1], [2]], 1, seq_ids=["x", "x"])
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        paged_greedy_generate(tiny, [[]], 1)


def test_pool_too_small_raises_no_free_blocks(tiny):
    manager, cache = pool(tiny, 2, 4)
    with pytest.raises(NoFreeBlocks):
        paged_greedy_generate(tiny, [list(range(1, 8))], 4, manager=manager, cache=cache)


def test_course_model_with_shared_prefix_equals_contiguous(model, prompts):
    """The course model, block size 4: two prompts share a 12-token prefix, hit in the same batch,
    then again on a second call; every call gives the contiguous path's tokens."""
    system = prompts[2][:8] + prompts[7][:4]
    assert len(system) == 12
    batch = [system + prompts[0], system + prompts[3], prompts[1]]
    want = greedy_generate(model, batch, 5)
    manager = KVCacheManager(blocks_needed(batch, 5, 4), 4)
    cache = PagedKVCache.for_model(model.config, manager.num_blocks, 4)
    assert paged_greedy_generate(model, batch, 5, manager=manager, cache=cache) == want
    assert manager.prefix_cache_stats.hits == 12
    assert paged_greedy_generate(model, batch[:2], 5, manager=manager, cache=cache) == want[:2]
    # 17 tokens each: 4 full blocks before the last token
    assert manager.prefix_cache_stats.hits == 12 + 2 * 16


def test_num_logits_returns_every_verified_position(tiny):
    """A verify step asks for the logits after each of a sequence's last m tokens: they equal the
    rows a full prefill computes at those positions, sequence by sequence."""
    prompts = [list(range(3, 14)), [9, 8, 7, 6, 5, 4]]
    manager = KVCacheManager(16, 4)
    cache = PagedKVCache.for_model(tiny.config, 16, 4)
    seqs = [Sequence(i, p, 4) for i, p in enumerate(prompts)]
    for s in seqs:
        manager.allocate(s)
    rows = paged_step(tiny, cache, manager, seqs, [0, 0], [11, 6], num_logits=[4, 1])
    assert rows.shape == (5, tiny.config.vocab_size)
    for s in seqs:
        manager.free(s)
    full = _all_position_logits(tiny, prompts)
    torch.testing.assert_close(rows[:4], full[0][-4:])
    torch.testing.assert_close(rows[4:], full[1][-1:])
    manager.allocate(seqs[0])
    with pytest.raises(ValueError, match="num_logits"):
        paged_step(tiny, cache, manager, seqs[:1], [0], [11], num_logits=[12])


def _all_position_logits(model, prompts):
    """Logits at every position of each prompt, one prompt per paged step (all rows requested)."""
    out = []
    for i, p in enumerate(prompts):
        manager = KVCacheManager(16, 4)
        cache = PagedKVCache.for_model(model.config, 16, 4)
        s = Sequence(i, p, 4)
        manager.allocate(s)
        out.append(paged_step(model, cache, manager, [s], [0], [len(p)], num_logits=[len(p)]))
    return out
