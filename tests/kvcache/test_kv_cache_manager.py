"""Block tables and the scheduler-facing operations: slot mapping, prefix hits, copy-on-write, rollback,
chunked allocation, running out of blocks, and random schedules checked against a simulated KV pool."""
from __future__ import annotations

from collections import Counter, defaultdict

import pytest
import torch
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radarlab.kvcache.block_pool import NoFreeBlocks, hash_block_chain, hash_block_tokens
from radarlab.kvcache.kv_cache_manager import AllocStatus, KVCacheManager
from radarlab.kvcache.sequence import Sequence


def snapshot(m: KVCacheManager):
    """Everything a failed call must leave as it was."""
    a = m.block_pool
    tables = {s: (list(t.block_ids), t.num_slots, t.num_cached_blocks) for s, t in m.block_tables.items()}
    return (tables, list(a.ref_counts), list(a.block_hashes), list(a.free_block_ids), list(a.evictable),
            dict(a.cached_block_ids), vars(a.prefix_cache_stats).copy())


def alloc(m, seq_id, tokens, num_new_tokens=None):
    """A new Sequence, allocated; returns it and the tokens served from the prefix cache."""
    seq = Sequence(seq_id, tokens)
    return seq, m.allocate(seq, num_new_tokens)


def grow(m, seq, new):
    """A decode step: the tokens join the sequence, then get slots. Returns copy-on-write pairs."""
    seq.append_token_ids(new)
    return m.allocate_slots(seq, len(new))


# --- the token store ----------------------------------------------------------------------------
def test_sequence_keeps_hashes_in_step_with_tokens():
    s = Sequence("s", [1, 2, 3], block_size=2)
    assert s.block_hashes == tuple(hash_block_chain([1, 2], 2))
    s.append_token_ids([4, 5])
    assert list(s.block_hashes) == hash_block_chain([1, 2, 3, 4], 2) and list(s.output_token_ids) == [4, 5]
    s.truncate(4)
    assert list(s.all_token_ids) == [1, 2, 3, 4] and len(s.block_hashes) == 2
    s.truncate(3)
    assert len(s.block_hashes) == 1
    with pytest.raises(ValueError, match="the prompt stays"):
        s.truncate(2)
    with pytest.raises(ValueError, match="blocks of 2, not 4"):
        s.bind_block_size(4)
    with pytest.raises(TypeError):
        s.all_token_ids[0] = 9  # read-only: nobody changes tokens behind the hashes' back
    assert not hasattr(s.all_token_ids, "append")


def test_sequence_bad_input():
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        Sequence("a", [])
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\] is 1.5"):
        Sequence("a", [1, 1.5])
    with pytest.raises(ValueError, match=r"prompt_token_ids\[0\] is -1"):
        Sequence("a", [-1])
    with pytest.raises(ValueError, match=r"token_ids\[0\] is -2"):
        Sequence("a", [1]).append_token_ids([-2])
    assert list(Sequence("a", torch.tensor([3, 4])).all_token_ids) == [3, 4]
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        Sequence("a", [1], block_size=3)


# --- slot mapping -----------------------------------------------------------------------------
def test_slot_mapping_lengths_1_bs_minus_1_bs_plus_1():
    m = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    other, _ = alloc(m, "other", [0, 0, 0, 0])  # block 0, so the tables below do not start at 0
    len1, hit1 = alloc(m, "len1", [7])
    len3, hit3 = alloc(m, "len3", [7, 8, 9])
    len5, hit5 = alloc(m, "len5", [1, 2, 3, 4, 5])
    assert hit1 == hit3 == hit5 == 0
    assert [m.get_block_table(s) for s in (len1, len3, len5)] == [[1], [2], [3, 4]]
    assert m.slot_mapping(len1, 0, 1) == [4]
    assert m.slot_mapping("len3", 0, 3) == [8, 9, 10]  # by id or by sequence
    assert m.slot_mapping(len5, 0, 5) == [12, 13, 14, 15, 16]  # slot = block_id * 4 + offset
    assert m.slot_mapping(len5, 3, 2) == [15, 16]
    m.free(other)  # free list is now 5, 6, 7, 0
    assert grow(m, len3, [10]) == [] and m.slot_mapping(len3, 3, 1) == [11]
    assert grow(m, len3, [11]) == []  # on a block boundary: a new block
    assert m.get_block_table(len3) == [2, 5]
    assert m.slot_mapping(len3, 0, 5) == [8, 9, 10, 11, 20]
    with pytest.raises(ValueError, match="outside the 5 positions that have slots"):
        m.slot_mapping(len3, 3, 3)


def test_batched_tensors():
    m = KVCacheManager(8, 4, enable_prefix_caching=False)
    a, _ = alloc(m, "a", [1])
    b, _ = alloc(m, "b", list(range(6)))
    bt = m.block_table_tensor([a, b])
    assert bt.dtype == torch.int32 and bt.tolist() == [[0, -1], [1, 2]]
    assert m.block_table_tensor(["a", "b"], max_blocks=3, pad=0).tolist() == [[0, 0, 0], [1, 2, 0]]
    with pytest.raises(ValueError, match="max_blocks is 1"):
        m.block_table_tensor([a, b], max_blocks=1)
    sm = m.slot_mapping_tensor([a, b], start_positions=[0, 4], query_lens=[1, 2], pad_to=5)
    assert sm.dtype == torch.int64 and sm.tolist() == [0, 8, 9, -1, -1]
    with pytest.raises(ValueError, match="pad_to=2"):
        m.slot_mapping_tensor([a, b], [0, 4], [1, 2], pad_to=2)
    assert m.block_table_tensor([]).shape == (0, 0)


# --- chunked allocation (vLLM v1) -------------------------------------------------------------
def test_allocate_reserves_the_first_chunk_but_needs_room_for_all():
    m = KVCacheManager(6, 4)
    a, hit = alloc(m, "a", list(range(18)), num_new_tokens=5)  # 5 blocks needed in all, 2 taken now
    assert hit == 0 and m.num_slots(a) == 5 and len(m.get_block_table(a)) == 2 and m.num_free_blocks == 4
    assert m.block_pool.num_cached_blocks == 1  # only block 0 is full of scheduled tokens
    assert m.allocate_slots(a, 7) == [] and m.num_slots(a) == 12 and len(m.get_block_table(a)) == 3
    with pytest.raises(ValueError, match="no tokens for 7 more slots"):
        m.allocate_slots(a, 7)  # 6 tokens are left without slots
    b = Sequence("b", list(range(100, 113)))  # 4 blocks; 3 are free, though its first chunk needs 1
    assert m.can_allocate(b) is AllocStatus.LATER
    with pytest.raises(NoFreeBlocks):
        m.allocate(b, 1)
    with pytest.raises(ValueError, match="num_new_tokens must be an int <= 18, got 19"):
        KVCacheManager(6, 4).allocate(Sequence("c", list(range(50, 68))), 19)


# --- prefix caching ---------------------------------------------------------------------------
def test_prefix_hits_reuse_full_blocks_and_recompute_last_token():
    m = KVCacheManager(8, 4)
    a, hit = alloc(m, "a", list(range(10)))
    assert hit == 0 and m.get_block_table(a) == [0, 1, 2]  # blocks 0, 1 full (cached), block 2 partial
    b, hit = alloc(m, "b", list(range(8)) + [50, 51])
    assert hit == 8 and m.get_block_table(b) == [0, 1, 3]
    assert [m.block_pool.ref_count(b) for b in range(4)] == [2, 2, 1, 1]
    # Fully cached and block aligned: the last block is recomputed so the last token yields logits.
    c, hit = alloc(m, "c", list(range(8)))
    assert hit == 4 and m.get_block_table(c) == [0, 4]
    assert m.block_pool.block_hashes[4] is None  # same content as block 1, which stays the cached one
    d, hit = alloc(m, "d", list(range(9)))
    assert hit == 8
    s = m.prefix_cache_stats
    assert (s.requests, s.queries, s.hits) == (4, 10 + 10 + 8 + 9, 0 + 8 + 4 + 8)
    assert s.hit_rate == pytest.approx(20 / 37)
    for seq in (a, b, c, d):
        m.free(seq)
    assert m.num_free_blocks == 8 and m.block_pool.num_cached_blocks == 2
    e, hit = alloc(m, "e", list(range(8)) + [99])
    assert hit == 8 and m.get_block_table(e)[:2] == [0,
                                                     1]  # hits survive their owners, from the evictable set


def test_decode_tokens_fill_and_register_blocks():
    m = KVCacheManager(8, 4)
    a, _ = alloc(m, "a", [1, 2, 3])
    grow(m, a, [4])  # block 0 is now full: registered under the hash the sequence computed
    h = hash_block_tokens(None, [1, 2, 3, 4])
    assert m.block_pool.get_cached_block(h) == 0 and a.block_hashes == (h,)
    assert alloc(m, "b", [1, 2, 3, 4, 5])[1] == 4


def test_a_block_is_cached_only_once_its_tokens_have_slots():
    m = KVCacheManager(8, 4)
    a, _ = alloc(m, "a", list(range(8)), num_new_tokens=3)
    assert len(a.block_hashes) == 2 and m.block_pool.num_cached_blocks == 0  # hashed, not yet cached
    m.allocate_slots(a, 1)
    assert m.block_pool.num_cached_blocks == 1


def test_lru_eviction_order_through_manager():
    m = KVCacheManager(4, 2)
    a, _ = alloc(m, "a", [1, 2, 3])  # blocks 0 (cached: [1, 2]) and 1
    b, _ = alloc(m, "b", [4, 5, 6])  # blocks 2 (cached: [4, 5]) and 3
    m.free(a)
    m.free(b)  # evictable, least recently freed first: 0, then 2
    assert list(m.block_pool.evictable) == [0, 2] and list(m.block_pool.free_block_ids) == [1, 3]
    c, _ = alloc(m, "c", [7, 8, 9, 10, 11])  # needs 3: the two never-cached blocks, then evicts block 0
    assert m.get_block_table(c) == [1, 3, 0]
    assert m.block_pool.get_cached_block(hash_block_tokens(None, [1, 2])) is None
    assert m.block_pool.get_cached_block(hash_block_tokens(None, [4, 5])) == 2
    m.free(c)
    assert alloc(m, "d", [4, 5, 0])[1] == 2


def test_free_releases_tail_first_so_prefix_is_evicted_last():
    m = KVCacheManager(4, 2)
    a, _ = alloc(m, "a", [1, 2, 3, 4, 5])  # blocks 0 and 1 cached, block 2 partial
    m.free(a)
    assert list(m.block_pool.evictable) == [1, 0]


def test_prefix_caching_disabled():
    m = KVCacheManager(8, 4, enable_prefix_caching=False)
    alloc(m, "a", list(range(9)))
    assert alloc(m, "b", list(range(9)))[1] == 0
    assert m.block_pool.num_cached_blocks == 0
    assert m.prefix_cache_stats.hit_rate == 0.0


# --- copy-on-write fork -----------------------------------------------------------------------
def test_fork_shares_and_copy_on_write():
    m = KVCacheManager(8, 4)
    p, _ = alloc(m, "p", list(range(6)))  # [0 full, 1 holding 2 tokens]
    free_before = m.num_free_blocks
    c = Sequence("c", list(range(6)))
    m.fork(p, c)
    assert m.get_block_table(c) == [0, 1] and m.num_free_blocks == free_before
    assert m.block_pool.ref_count(0) == m.block_pool.ref_count(1) == 2
    assert grow(m, p, [6]) == [(1, 2)]  # p writes into shared block 1: private copy 2
    assert m.get_block_table(p) == [0, 2] and m.slot_mapping(p, 6, 1) == [10]
    assert (m.block_pool.ref_count(1), m.block_pool.ref_count(2)) == (1, 1)
    assert grow(m, c, [7]) == []  # c is now block 1's only holder
    assert m.get_block_table(c) == [0, 1] and m.slot_mapping(c, 6, 1) == [6]
    assert m.block_pool.ref_count(0) == 2  # the full prompt block stays shared, read-only
    m.free(p)
    assert m.block_pool.ref_count(0) == 1 and m.block_pool.ref_count(2) == 0
    with pytest.raises(ValueError, match="already has a block table"):
        m.fork(c, c)
    with pytest.raises(ValueError, match="does not start with the 7 tokens"):
        m.fork(c, Sequence("d", [9] * 7))


def test_fork_on_block_boundary_needs_no_copy():
    m = KVCacheManager(8, 4)
    p, _ = alloc(m, "p", list(range(8)))
    c = Sequence("c", list(range(8)))
    m.fork(p, c)
    assert grow(m, p, [8]) == [] and grow(m, c, [9]) == []
    assert m.get_block_table(p)[:2] == m.get_block_table(c)[:2]
    assert m.get_block_table(p)[2] != m.get_block_table(c)[2]


# --- rollback ---------------------------------------------------------------------------------
def drop(m, seq, n):
    """What a draft model does with its own copy after n of its drafts were rejected: the tokens go
    (the sequence's business), then their slots (the manager's)."""
    seq.truncate(seq.num_tokens - n)
    m.rollback_slots(seq, min(m.num_slots(seq), seq.num_tokens))


def test_rollback_frees_empty_blocks():
    m = KVCacheManager(8, 4, enable_prefix_caching=False)
    a, _ = alloc(m, "a", list(range(6)))
    grow(m, a, [6, 7, 8])  # 9 tokens in blocks 0, 1, 2
    drop(m, a, 3)
    assert m.num_slots(a) == a.num_tokens == 6 and m.get_block_table(a) == [0, 1] and m.num_free_blocks == 6
    drop(m, a, 0)
    assert m.num_slots(a) == 6
    with pytest.raises(ValueError, match="the prompt stays"):
        drop(m, a, 1)
    with pytest.raises(ValueError, match="cannot keep 7"):
        m.rollback_slots(a, 7)  # more than it has slots for
    assert grow(m, a, [60, 70]) == [] and list(a.all_token_ids) == [0, 1, 2, 3, 4, 5, 60, 70]


def test_rollback_into_cached_block_uncaches_it_before_writing():
    m = KVCacheManager(8, 4)
    a, _ = alloc(m, "a", list(range(6)))
    grow(m, a, [6, 7])  # both blocks full and cached
    h1 = a.block_hashes[1]
    drop(m, a, 2)
    assert len(a.block_hashes) == 1
    assert m.block_pool.get_cached_block(h1) == 1  # content intact until a write
    grow(m, a, [60])
    assert m.block_pool.get_cached_block(h1) is None and m.block_pool.block_hashes[1] is None
    grow(m, a, [70])  # full again, new content, registered under its new hash
    assert m.block_pool.get_cached_block(hash_block_chain([0, 1, 2, 3, 4, 5, 60, 70], 4)[1]) == 1


def test_rollback_into_block_someone_hit_copies_on_write():
    m = KVCacheManager(8, 4)
    a, _ = alloc(m, "a", list(range(6)))
    grow(m, a, [6, 7])
    drop(m, a, 2)
    b, hit = alloc(m, "b", list(range(8)) + [99])
    assert hit == 8  # block 1 still holds 0..7's KV: a valid hit
    assert grow(m, a, [60]) == [(1, m.get_block_table(a)[1])]
    assert m.get_block_table(a)[1] != 1 and m.block_pool.ref_count(1) == 1


# --- running out, bad input -------------------------------------------------------------------
def test_out_of_blocks_raises_and_changes_nothing():
    m = KVCacheManager(2, 4)
    a, _ = alloc(m, "a", list(range(8)))
    before = snapshot(m)
    b = Sequence("b", [1])
    assert m.can_allocate(b) is AllocStatus.LATER and not m.can_allocate(b)
    with pytest.raises(NoFreeBlocks):
        m.allocate(b)
    a.append_token_ids([8])
    assert not m.can_allocate_slots(a)
    with pytest.raises(NoFreeBlocks):
        m.allocate_slots(a)
    assert snapshot(m) == before and "b" not in m
    big = Sequence("big", list(range(9)))
    assert m.can_allocate(big) is AllocStatus.NEVER
    with pytest.raises(ValueError, match="needs 3 blocks of 4; the whole pool has 2"):
        m.allocate(big)
    assert snapshot(m) == before


def test_copy_on_write_without_free_block_raises_and_changes_nothing():
    m = KVCacheManager(2, 4)
    a, _ = alloc(m, "a", list(range(6)))
    b = Sequence("b", list(range(6)))
    m.fork(a, b)
    before = snapshot(m)
    a.append_token_ids([6])
    with pytest.raises(NoFreeBlocks, match="needs 1 free blocks for 1 new tokens"):
        m.allocate_slots(a)
    assert snapshot(m) == before
    m.free(b)
    assert m.allocate_slots(a) == []


def test_cache_hits_revived_from_evictable_count_against_free_blocks():
    m = KVCacheManager(3, 2)
    a, _ = alloc(m, "a", [1, 2, 3])  # block 0 cached, block 1
    m.free(a)  # free: 2, 1; evictable: 0
    alloc(m, "c", [7])  # takes block 2
    b = Sequence("b", [1, 2, 9, 9, 9])  # hits block 0, needs 2 more: 3 free blocks in all, only 2 are free
    assert m.can_allocate(b) is AllocStatus.LATER
    before = snapshot(m)
    with pytest.raises(NoFreeBlocks):
        m.allocate(b)
    assert snapshot(m) == before
    m.free("c")
    assert m.can_allocate(b) and m.allocate(b) == 2


def test_bad_input():
    m = KVCacheManager(4, 4)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, 3)
    a, _ = alloc(m, "a", [3, 4])
    with pytest.raises(ValueError, match="already has a block table"):
        m.allocate(Sequence("a", [1]))
    with pytest.raises(ValueError, match="num_new_tokens must be a non-negative int"):
        m.allocate_slots(a, -1)
    with pytest.raises(ValueError, match="num_new_tokens must be an int"):
        m.allocate_slots(a, True)
    with pytest.raises(ValueError, match="blocks of 4, not 2"):
        KVCacheManager(4, 2).allocate(a)  # a sequence is hashed for one block size
    m.free(a)
    with pytest.raises(KeyError, match="already freed"):
        m.free(a)
    with pytest.raises(KeyError, match="'zz' has no block table"):
        m.allocate_slots(Sequence("zz", [1]), 1)
    assert m.num_free_blocks == 4


# --- random schedules -------------------------------------------------------------------------
TOKENS = st.integers(0, 2)  # a tiny vocabulary, so sequences often share content
BASES = [[0, 1, 2, 0, 1, 2, 0, 1], [0, 1, 2, 0, 2, 2, 1, 0], [1, 1, 1, 1, 1, 1, 1, 1]]
# Prompts start with a prefix of a few shared texts, so the prefix cache hits often.
PROMPTS = st.builds(lambda base, n, tail: base[:n] + tail,
                    st.sampled_from(BASES), st.integers(0, 8), st.lists(TOKENS, max_size=3)).filter(len)


class PagedCacheMachine(RuleBasedStateMachine):
    """Random allocate (whole or chunked) / append / fork / rollback / preempt / free against a
    simulated pool.

    Each sequence is a Sequence, the one owner of its tokens and block hashes. The pool maps slot ->
    the tokens whose KV that slot encodes (the token at that position and all before it, since K and
    V depend on the whole prefix). We play the model's part: write the slots each call reserves and
    perform the copy-on-write copies it returns. Then every live sequence must read its own prefix at
    every position with a slot: nothing it relies on was overwritten, and every prefix-cache hit
    served the right KV; and every cached block's hash is the one recomputed from its owner's tokens.
    """

    @initialize(num_blocks=st.integers(3, 16), block_size=st.sampled_from([1, 2, 4, 4]),
                caching=st.booleans())
    def setup(self, num_blocks, block_size, caching):
        self.m = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.bs = block_size
        self.pool: dict[int, tuple[int, ...]] = {}
        self.seqs: dict[int, Sequence] = {}
        self.next_id = 0

    def write(self, seq, start, n):
        tokens = list(seq.all_token_ids)
        for pos, slot in zip(range(start, start + n), self.m.slot_mapping(seq, start, n)):
            self.pool[slot] = tuple(tokens[:pos + 1])

    def copy(self, copies):
        for src, dst in copies:
            for off in range(self.bs):
                if src * self.bs + off in self.pool:
                    self.pool[dst * self.bs + off] = self.pool[src * self.bs + off]

    def pick(self, i):
        return self.seqs[sorted(self.seqs)[i % len(self.seqs)]]

    @precondition(lambda self: len(self.seqs) < 4)  # keep a few alive, so the pool is not always full
    @rule(prompt=PROMPTS, chunk=st.integers(1, 12))
    def allocate(self, prompt, chunk):
        """Admission as the scheduler does it: the whole prompt must fit, the first chunk gets slots."""
        seq, self.next_id = Sequence(self.next_id, prompt), self.next_id + 1
        status, before = self.m.can_allocate(seq), snapshot(self.m)
        _, cached = self.m.get_computed_blocks(seq)
        try:
            computed = self.m.allocate(seq, min(chunk, len(prompt) - cached))
        except NoFreeBlocks:
            assert status is AllocStatus.LATER and snapshot(self.m) == before
            return
        except ValueError:
            assert status is AllocStatus.NEVER and snapshot(self.m) == before
            return
        assert status is AllocStatus.OK and computed == cached
        assert 0 <= computed < len(prompt) and computed % self.bs == 0
        self.seqs[seq.seq_id] = seq
        for pos, slot in enumerate(self.m.slot_mapping(seq, 0, computed)):  # cache hits hold our KV
            assert self.pool[slot] == tuple(prompt[:pos + 1])
        self.write(seq, computed, self.m.num_slots(seq) - computed)

    def reserve_and_write(self, seq, n) -> bool:
        """allocate_slots for the sequence's next n tokens, then do what the pool would: the
        copy-on-write copies, then the writes."""
        can, before = self.m.can_allocate_slots(seq, n), snapshot(self.m)
        start = self.m.num_slots(seq)
        try:
            copies = self.m.allocate_slots(seq, n)
        except NoFreeBlocks:
            assert not can and snapshot(self.m) == before
            return False
        assert can and len(copies) <= 1
        self.copy(copies)
        self.write(seq, start, n)
        return True

    @precondition(lambda self: any(s.num_tokens > self.m.num_slots(s) for s in self.seqs.values()))
    @rule(i=st.integers(0, 99), chunk=st.integers(1, 12))
    def prefill_chunk(self, i, chunk):
        seq = self.pick(i)
        left = seq.num_tokens - self.m.num_slots(seq)
        if left > 0:  # none where a rejected draft left slots past the tokens
            self.reserve_and_write(seq, min(chunk, left))

    def decode(self, seq, new) -> bool:
        """The sampled tokens join the sequence, then get slots (all of them, as in a verify step)."""
        left = seq.num_tokens - self.m.num_slots(seq)
        if left or not new:
            return False
        seq.append_token_ids(new)
        if self.reserve_and_write(seq, len(new)):
            return True
        seq.truncate(seq.num_tokens - len(new))  # what a scheduler does on NoFreeBlocks: wait or preempt
        return False

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99), new=st.lists(TOKENS, max_size=3))
    def append(self, i, new):
        self.decode(self.pick(i), new)

    @precondition(lambda self: 0 < len(self.seqs) < 6)
    @rule(i=st.integers(0, 99))
    def fork(self, i):
        parent = self.pick(i)
        if self.m.num_slots(parent) > parent.num_tokens:  # the engine forks right after a prompt, never then
            return
        num_slots = self.m.num_slots(parent)
        child, self.next_id = Sequence(self.next_id, parent.all_token_ids[:num_slots]), self.next_id + 1
        self.m.fork(parent, child)
        self.seqs[child.seq_id] = child

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99), n=st.integers(0, 5))
    def rollback(self, i, n):
        seq = self.pick(i)
        drop(self.m, seq, min(n, seq.num_output_tokens))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99), drafts=st.lists(TOKENS, min_size=1, max_size=4), rejected=st.integers(0, 4),
          bonus=TOKENS)
    def speculate(self, i, drafts, rejected, bonus):
        """One speculative step: slots for the drafts, roll back the rejected ones, then the bonus
        token the target model samples, written right after the rollback."""
        seq = self.pick(i)
        if self.decode(seq, drafts):
            drop(self.m, seq, min(rejected, len(drafts)))
            self.decode(seq, [bonus])

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99), drafts=st.lists(TOKENS, min_size=1, max_size=4), rejected=st.integers(0, 4),
          bonus=TOKENS)
    def speculate_with_lookahead(self, i, drafts, rejected, bonus):
        """The engine's speculative step (vLLM v1's): the drafts stay beside the sequence and get
        lookahead slots, their KV is written there; the accepted ones and the target's token then
        join the sequence, and the rejected drafts' slots stay reserved, holding stale KV, until the
        next tokens are written over them."""
        seq = self.pick(i)
        start = self.m.num_slots(seq)
        if start != seq.num_tokens:
            return
        can, before = self.m.can_allocate_slots(seq, len(drafts)), snapshot(self.m)
        try:
            copies = self.m.allocate_slots(seq, len(drafts), num_lookahead_tokens=len(drafts))
        except NoFreeBlocks:
            assert not can and snapshot(self.m) == before
            return
        assert can and len(copies) <= 1 and seq.num_tokens == start  # the manager never touched the tokens
        self.copy(copies)
        guess = list(seq.all_token_ids) + drafts
        for pos, slot in zip(range(start, start + len(drafts)), self.m.slot_mapping(seq, start, len(drafts))):
            self.pool[slot] = tuple(guess[:pos + 1])
        accepted = len(drafts) - min(rejected, len(drafts))
        seq.append_token_ids(drafts[:accepted] + [bonus])
        where = seq.num_tokens - 1  # the target's token: in a reserved slot, or in a new one
        extra = max(0, where + 1 - self.m.num_slots(seq))
        try:
            self.copy(self.m.allocate_slots(seq, extra))
        except NoFreeBlocks:
            seq.truncate(seq.num_tokens - 1)  # no room for it: the scheduler would wait or preempt
            return
        self.write(seq, where, 1)

    @precondition(lambda self: any(self.m.num_slots(s) <= s.num_tokens for s in self.seqs.values()))
    @rule(i=st.integers(0, 99), new=st.lists(TOKENS, min_size=1, max_size=3))
    def preempt_before_compute(self, i, new):
        """Slots reserved for a step that never runs (the request is preempted or aborted first):
        its blocks past what was computed must not stay findable in the prefix cache."""
        seq = self.pick(i)
        computed = self.m.num_slots(seq)
        if computed > seq.num_tokens:
            return
        if seq.num_tokens == computed:
            seq.append_token_ids(new)
        try:
            self.m.allocate_slots(seq, seq.num_tokens - computed)  # reserved, never written
        except NoFreeBlocks:
            pass
        self.m.free(seq, computed)
        del self.seqs[seq.seq_id]

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 99))
    def free(self, i):
        seq = self.pick(i)
        self.m.free(seq)
        del self.seqs[seq.seq_id]

    @invariant()
    def no_leaks(self):
        a = self.m.block_pool
        used = {b for b in range(a.num_blocks) if a.ref_counts[b] > 0}
        free, evictable = set(a.free_block_ids), set(a.evictable)
        assert len(free) == len(a.free_block_ids) and not free & evictable and not (free | evictable) & used
        assert a.num_free_blocks + len(used) == a.num_blocks
        assert (free | evictable | used) == set(range(a.num_blocks))

    @invariant()
    def ref_counts_equal_holders(self):
        a = self.m.block_pool
        holders = Counter()
        for table in self.m.block_tables.values():
            assert len(set(table.block_ids)) == len(table.block_ids)
            assert len(table.block_ids) == -(-table.num_slots // self.bs)
            assert all(0 <= b < a.num_blocks for b in table.block_ids)
            holders.update(table.block_ids)
        assert all(a.ref_counts[b] == holders[b] for b in range(a.num_blocks))

    @invariant()
    def every_sequence_reads_its_own_kv(self):
        assert self.seqs.keys() == self.m.block_tables.keys()
        owners = defaultdict(list)
        for seq in self.seqs.values():
            tokens = list(seq.all_token_ids)
            # past its tokens: a rejected draft's slot, stale until rewritten
            num_slots = self.m.num_slots(seq)
            for pos, slot in enumerate(self.m.slot_mapping(seq, 0, min(num_slots, len(tokens)))):
                assert self.pool[slot] == tuple(tokens[:pos + 1]), \
                    f"seq {seq.seq_id} position {pos} was overwritten"
                owners[slot].append(seq.seq_id)
        # A slot owned by two live sequences lives in a shared block (ref > 1) that holds the same KV
        # for both, checked above: it is shared read-only. The next slot each sequence will write is in
        # a block it alone holds, or allocate_slots copies the block first (checked by the writes).
        for slot, seqs in owners.items():
            if len(seqs) > 1:
                assert self.m.block_pool.ref_counts[slot // self.bs] >= len(seqs)

    @invariant()
    def cached_hashes_are_the_owners_hashes(self):
        """The one token store: each sequence's hashes are those of its tokens, and every cached full
        block of a live sequence is cached under exactly the hash recomputed from the owner's tokens."""
        a = self.m.block_pool
        for seq in self.seqs.values():
            tokens = list(seq.all_token_ids)
            if not a.enable_prefix_caching:  # nothing is hashed or cached (as in vLLM)
                assert a.num_cached_blocks == 0
                continue
            assert list(seq.block_hashes) == hash_block_chain(tokens, self.bs)
            table = self.m.block_tables[seq.seq_id]
            for i in range(min(table.num_slots, len(tokens)) // self.bs):
                block = table.block_ids[i]
                if a.block_hashes[block] is not None:
                    assert a.block_hashes[block] == seq.block_hashes[i]

    @invariant()
    def cached_blocks_hold_what_their_hash_names(self):
        a = self.m.block_pool
        for block_hash, b in a.cached_block_ids.items():
            assert a.block_hashes[b] == block_hash
            prefix = self.pool[b * self.bs + self.bs - 1]  # the block's last slot names the whole prefix
            assert len(prefix) % self.bs == 0 and hash_block_chain(prefix, self.bs)[-1] == block_hash
            for off in range(self.bs):
                assert self.pool[b * self.bs + off] == prefix[:len(prefix) - self.bs + off + 1]
        for b in range(a.num_blocks):
            assert (a.block_hashes[b] is not None) == (b in a.cached_block_ids.values())


PagedCacheMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)
test_random_schedules = PagedCacheMachine.TestCase
