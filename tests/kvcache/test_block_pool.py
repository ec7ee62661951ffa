"""The block allocator's contract: free list, reference counts, prefix-cache hashing and LRU eviction."""
from __future__ import annotations

import pytest

from radarlab.kvcache.block_pool import (
    BlockPool,
    NoFreeBlocks,
    PrefixCacheStats,
    hash_block_chain,
    hash_block_tokens,
)


def state(a: BlockPool):
    """Everything an allocation could change, to check that a failed one changed nothing."""
    return (list(a.ref_counts), list(a.block_hashes), list(a.free_block_ids), list(a.evictable),
            dict(a.cached_block_ids))


# --- bad input --------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [0, -4, 3, 6, 24, 2.0, True, None])
def test_invalid_block_size_names_the_field(block_size):
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(8, block_size)


@pytest.mark.parametrize("num_blocks", [0, -1, 2.5, None])
def test_invalid_num_blocks_names_the_field(num_blocks):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks, 16)


@pytest.mark.parametrize("block_size", [1, 2, 4, 8, 16, 32, 256])
def test_powers_of_two_accepted(block_size):
    assert BlockPool(4, block_size).block_size == block_size


@pytest.mark.parametrize("block_id", [-1, 4, 100])
def test_block_id_outside_pool_raises(block_id):
    a = BlockPool(4, 16)
    for op in (a.free, a.incref, a.ref_count, a.uncache_block):
        with pytest.raises(ValueError, match="outside the pool"):
            op(block_id)


# --- free list and reference counts -----------------------------------------------------------
def test_allocate_and_free_counts():
    a = BlockPool(4, 16)
    assert a.allocate_many(3) == [0, 1, 2]
    assert (a.num_free_blocks, a.num_used_blocks) == (1, 3)
    a.free(1)
    assert a.allocate_many(2) == [3, 1]  # freed blocks go to the back of the free list
    assert a.num_free_blocks == 0


def test_double_free_raises():
    a = BlockPool(4, 16)
    b = a.allocate()
    a.free(b)
    with pytest.raises(ValueError, match="double free of block 0"):
        a.free(b)
    with pytest.raises(ValueError, match="double free of block 3"):
        a.free(3)  # never allocated


def test_freeing_shared_block_only_decrements():
    a = BlockPool(2, 16)
    b = a.allocate()
    a.incref(b)
    a.free(b)
    assert a.ref_count(b) == 1 and a.num_free_blocks == 1
    a.free(b)
    assert a.ref_count(b) == 0 and a.num_free_blocks == 2


def test_out_of_blocks_raises_and_changes_nothing():
    a = BlockPool(3, 4)
    a.allocate()
    before = state(a)
    with pytest.raises(NoFreeBlocks, match="need 3 free KV blocks, only 2"):
        a.allocate_many(3)
    assert state(a) == before
    a.allocate_many(2)
    before = state(a)
    with pytest.raises(NoFreeBlocks):
        a.allocate()
    assert state(a) == before


def test_incref_of_plain_free_block_raises():
    a = BlockPool(2, 4)
    with pytest.raises(ValueError, match="holds no cached content"):
        a.incref(0)


# --- hashing ----------------------------------------------------------------------------------
def test_hash_chain_depends_on_parent_and_tokens():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert h0 == hash_block_tokens(None, (1, 2, 3, 4))
    assert h0 != hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(h0, [5, 6, 7, 8]) != hash_block_tokens(None, [5, 6, 7, 8])
    assert hash_block_chain([1, 2, 3, 4, 5, 6, 7, 8, 9], 4) == [h0, hash_block_tokens(h0, [5, 6, 7, 8])]
    assert hash_block_chain([1, 2, 3], 4) == []
    # Python's own hash collides here; ours does not.
    assert hash(-1) == hash(-2)
    assert hash_block_tokens(None, [-1]) != hash_block_tokens(None, [-2])


def test_hash_is_stable_across_processes():
    """A fixed value: the same tokens hash the same in every process, Python version and machine."""
    assert hash_block_chain(list(range(8)), 4)[-1].hex() == (
        "9feffc04d3a809726d3cc9f61b10b629c1619357fa1fe4d7a80e31b6ecaf4caa")


# --- prefix cache -----------------------------------------------------------------------------
def test_freed_cached_block_stays_findable_until_evicted():
    a = BlockPool(2, 4)
    b = a.allocate()
    h = hash_block_tokens(None, [1, 2, 3, 4])
    assert a.cache_full_block(b, h)
    a.free(b)
    assert a.num_free_blocks == 2 and a.get_cached_block(h) == b and list(a.evictable) == [b]
    a.incref(b)  # a hit revives it
    assert a.ref_count(b) == 1 and not a.evictable and a.num_free_blocks == 1
    a.free(b)
    a.allocate()  # takes the never-cached block 1 first
    assert a.get_cached_block(h) == b
    assert a.allocate() == b  # now b must be evicted
    assert a.get_cached_block(h) is None and a.block_hashes[b] is None


def test_lru_evicts_least_recently_freed_first():
    a = BlockPool(4, 1)
    blocks = a.allocate_many(3)
    hashes = [hash_block_tokens(None, [t]) for t in range(3)]
    for b, h in zip(blocks, hashes):
        a.cache_full_block(b, h)
    for b in (1, 0, 2):
        a.free(b)
    assert a.allocate() == 3  # truly free first
    assert [a.allocate() for _ in range(3)] == [1, 0, 2]
    assert a.num_cached_blocks == 0


def test_hit_refreshes_lru_position():
    a = BlockPool(2, 1)
    b0, b1 = a.allocate_many(2)
    a.cache_full_block(b0, b"h0")
    a.cache_full_block(b1, b"h1")
    a.free(b0)
    a.free(b1)
    a.incref(b0)  # b0 is used again, then freed last: b1 is now the older one
    a.free(b0)
    assert a.allocate() == b1


def test_duplicate_content_keeps_first_cached_block():
    a = BlockPool(2, 4)
    b0, b1 = a.allocate_many(2)
    assert a.cache_full_block(b0, b"h")
    assert not a.cache_full_block(b1, b"h")
    assert a.get_cached_block(b"h") == b0 and a.block_hashes[b1] is None
    a.free(b1)
    assert list(a.free_block_ids) == [b1] and not a.evictable


def test_find_longest_cache_hit_stops_at_first_miss():
    a = BlockPool(4, 4)
    chain = hash_block_chain(list(range(16)), 4)
    for b, h in zip(a.allocate_many(4), chain):
        a.cache_full_block(b, h)
    a.uncache_block(2)
    assert a.find_longest_cache_hit(chain) == [0, 1]


def test_prefix_caching_disabled_never_caches():
    a = BlockPool(2, 4, enable_prefix_caching=False)
    b = a.allocate()
    assert not a.cache_full_block(b, b"h")
    assert a.get_cached_block(b"h") is None
    a.free(b)
    assert not a.evictable


def test_stats_hit_rate():
    s = PrefixCacheStats()
    assert s.hit_rate == 0.0
    s.record(10, 8)
    s.record(10, 0)
    assert (s.requests, s.queries, s.hits) == (2, 20, 8)
    assert s.hit_rate == 0.4
