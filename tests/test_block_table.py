"""Block tables and the scheduler-facing operations: slot mapping, prefix hits, copy-on-write, rollback,
running out of blocks, and random schedules checked against a simulated KV pool."""
from __future__ import annotations

from collections import Counter, defaultdict

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radarlab.kvcache.block_table import AllocStatus, BlockSpaceManager, check_block_table
from radarlab.kvcache.blocks import NoFreeBlocks, hash_block_chain, hash_block_tokens


def snapshot(m: BlockSpaceManager):
    """Everything a failed call must leave as it was."""
    a = m.allocator
    tables = {s: (list(t.block_ids), list(t.token_ids), list(t.block_hashes)) for s, t in m.block_tables.items()}
    return (tables, list(a.ref_counts), list(a.block_hashes), list(a.free_block_ids), list(a.evictable),
            dict(a.cached_block_ids), vars(a.prefix_cache_stats).copy())


# --- slot mapping -----------------------------------------------------------------------------
def test_slot_mapping_lengths_1_bs_minus_1_bs_plus_1():
    m = BlockSpaceManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    m.allocate("other", [0, 0, 0, 0])  # block 0, so the tables below do not start at 0
    assert m.allocate("len1", [7]) == 0
    assert m.allocate("len3", [7, 8, 9]) == 0
    assert m.allocate("len5", [1, 2, 3, 4, 5]) == 0
    assert [m.get_block_table(s) for s in ("len1", "len3", "len5")] == [[1], [2], [3, 4]]
    assert m.slot_mapping("len1", 0, 1) == [4]
    assert m.slot_mapping("len3", 0, 3) == [8, 9, 10]
    assert m.slot_mapping("len5", 0, 5) == [12, 13, 14, 15, 16]  # slot = block_id * 4 + offset
    assert m.slot_mapping("len5", 3, 2) == [15, 16]
    m.free("other")  # free list is now 5, 6, 7, 0
    assert m.append_slots("len3", [10]) == [] and m.slot_mapping("len3", 3, 1) == [11]
    assert m.append_slots("len3", [11]) == []  # on a block boundary: a new block
    assert m.get_block_table("len3") == [2, 5]
    assert m.slot_mapping("len3", 0, 5) == [8, 9, 10, 11, 20]
    with pytest.raises(ValueError, match="outside the sequence's 5 tokens"):
        m.slot_mapping("len3", 3, 3)


def test_batched_tensors():
    m = BlockSpaceManager(8, 4, enable_prefix_caching=False)
    m.allocate("a", [1])
    m.allocate("b", list(range(6)))
    bt = m.block_table_tensor(["a", "b"])
    assert bt.dtype == torch.int32 and bt.tolist() == [[0, -1], [1, 2]]
    assert m.block_table_tensor(["a", "b"], max_blocks=3, pad=0).tolist() == [[0, 0, 0], [1, 2, 0]]
    with pytest.raises(ValueError, match="max_blocks is 1"):
        m.block_table_tensor(["a", "b"], max_blocks=1)
    sm = m.slot_mapping_tensor(["a", "b"], start_positions=[0, 4], query_lens=[1, 2], pad_to=5)
    assert sm.dtype == torch.int64 and sm.tolist() == [0, 8, 9, -1, -1]
    with pytest.raises(ValueError, match="pad_to=2"):
        m.slot_mapping_tensor(["a", "b"], [0, 4], [1, 2], pad_to=2)
    assert m.block_table_tensor([]).shape == (0, 0)


def test_block_table_outside_pool_raises():
    with pytest.raises(ValueError, match="entry 2 is 4"):
        check_block_table([0, 3, 4], num_blocks=4)
    check_block_table([0, 3, -1], num_blocks=4, pad=-1)
    m = BlockSpaceManager(4, 4)
    m.allocate("a", [1, 2])
    m.block_tables["a"].block_ids[0] = 99  # a corrupted table must not reach a kernel
    with pytest.raises(ValueError, match="outside the pool"):
        m.block_table_tensor(["a"])


# --- prefix caching ---------------------------------------------------------------------------
def test_prefix_hits_reuse_full_blocks_and_recompute_last_token():
    m = BlockSpaceManager(8, 4)
    assert m.allocate("a", list(range(10))) == 0  # blocks 0, 1 full (cached), block 2 partial
    assert m.get_block_table("a") == [0, 1, 2]
    assert m.allocate("b", list(range(8)) + [50, 51]) == 8
    assert m.get_block_table("b") == [0, 1, 3]
    assert [m.allocator.ref_count(b) for b in range(4)] == [2, 2, 1, 1]
    # Fully cached and block aligned: the last block is recomputed so the last token yields logits.
    assert m.allocate("c", list(range(8))) == 4
    assert m.get_block_table("c") == [0, 4]
    assert m.allocator.block_hashes[4] is None  # same content as block 1, which stays the cached one
    assert m.allocate("d", list(range(9))) == 8
    s = m.prefix_cache_stats
    assert (s.requests, s.queries, s.hits) == (4, 10 + 10 + 8 + 9, 0 + 8 + 4 + 8)
    assert (s.query_blocks, s.hit_blocks) == (2 + 2 + 1 + 2, 0 + 2 + 1 + 2)
    assert s.hit_rate == pytest.approx(20 / 37)
    for seq in "abcd":
        m.free(seq)
    assert m.num_free_blocks == 8 and m.allocator.num_cached_blocks == 2
    assert m.allocate("e", list(range(8)) + [99]) == 8  # hits survive their owners, from the evictable set
    assert m.get_block_table("e")[:2] == [0, 1]


def test_decode_tokens_fill_and_register_blocks():
    m = BlockSpaceManager(8, 4)
    m.allocate("a", [1, 2, 3])
    m.append_slots("a", [4])  # block 0 is now full: registered
    h = hash_block_tokens(None, [1, 2, 3, 4])
    assert m.allocator.get_cached_block(h) == 0
    assert m.block_tables["a"].block_hashes == [h]
    assert m.allocate("b", [1, 2, 3, 4, 5]) == 4


def test_lru_eviction_order_through_manager():
    m = BlockSpaceManager(4, 2)
    m.allocate("a", [1, 2, 3])  # blocks 0 (cached: [1, 2]) and 1
    m.allocate("b", [4, 5, 6])  # blocks 2 (cached: [4, 5]) and 3
    m.free("a")
    m.free("b")  # evictable, least recently freed first: 0, then 2
    assert list(m.allocator.evictable) == [0, 2] and list(m.allocator.free_block_ids) == [1, 3]
    m.allocate("c", [7, 8, 9, 10, 11])  # needs 3: the two never-cached blocks, then evicts block 0
    assert m.get_block_table("c") == [1, 3, 0]
    assert m.allocator.get_cached_block(hash_block_tokens(None, [1, 2])) is None
    assert m.allocator.get_cached_block(hash_block_tokens(None, [4, 5])) == 2
    m.free("c")
    assert m.allocate("d", [4, 5, 0]) == 2


def test_free_releases_tail_first_so_prefix_is_evicted_last():
    m = BlockSpaceManager(4, 2)
    m.allocate("a", [1, 2, 3, 4, 5])  # blocks 0 and 1 cached, block 2 partial
    m.free("a")
    assert list(m.allocator.evictable) == [1, 0]


def test_prefix_caching_disabled():
    m = BlockSpaceManager(8, 4, enable_prefix_caching=False)
    m.allocate("a", list(range(9)))
    assert m.allocate("b", list(range(9))) == 0
    assert m.allocator.num_cached_blocks == 0 and m.block_tables["a"].block_hashes == []
    assert m.prefix_cache_stats.hit_rate == 0.0


# --- copy-on-write fork -----------------------------------------------------------------------
def test_fork_shares_and_copy_on_write():
    m = BlockSpaceManager(8, 4)
    m.allocate("p", list(range(6)))  # [0 full, 1 holding 2 tokens]
    free_before = m.num_free_blocks
    m.fork("p", "c")
    assert m.get_block_table("c") == [0, 1] and m.num_free_blocks == free_before
    assert m.allocator.ref_count(0) == m.allocator.ref_count(1) == 2
    assert m.append_slots("p", [6]) == [(1, 2)]  # p writes into shared block 1: private copy 2
    assert m.get_block_table("p") == [0, 2] and m.slot_mapping("p", 6, 1) == [10]
    assert (m.allocator.ref_count(1), m.allocator.ref_count(2)) == (1, 1)
    assert m.append_slots("c", [7]) == []  # c is now block 1's only holder
    assert m.get_block_table("c") == [0, 1] and m.slot_mapping("c", 6, 1) == [6]
    assert m.allocator.ref_count(0) == 2  # the full prompt block stays shared, read-only
    m.free("p")
    assert m.allocator.ref_count(0) == 1 and m.allocator.ref_count(2) == 0
    with pytest.raises(ValueError, match="already has a block table"):
        m.fork("c", "c")


def test_fork_on_block_boundary_needs_no_copy():
    m = BlockSpaceManager(8, 4)
    m.allocate("p", list(range(8)))
    m.fork("p", "c")
    assert m.append_slots("p", [8]) == [] and m.append_slots("c", [9]) == []
    assert m.get_block_table("p")[:2] == m.get_block_table("c")[:2]
    assert m.get_block_table("p")[2] != m.get_block_table("c")[2]


# --- rollback ---------------------------------------------------------------------------------
def test_rollback_frees_empty_blocks():
    m = BlockSpaceManager(8, 4, enable_prefix_caching=False)
    m.allocate("a", list(range(6)))
    m.append_slots("a", [6, 7, 8])  # 9 tokens in blocks 0, 1, 2
    m.rollback("a", 3)
    assert m.num_tokens("a") == 6 and m.get_block_table("a") == [0, 1] and m.num_free_blocks == 6
    m.rollback("a", 0)
    assert m.num_tokens("a") == 6
    with pytest.raises(ValueError, match="cannot roll back 6"):
        m.rollback("a", 6)
    assert m.append_slots("a", [60, 70]) == [] and m.block_tables["a"].token_ids == [0, 1, 2, 3, 4, 5, 60, 70]


def test_rollback_into_cached_block_uncaches_it_before_writing():
    m = BlockSpaceManager(8, 4)
    m.allocate("a", list(range(8)))  # both blocks full and cached
    h1 = m.block_tables["a"].block_hashes[1]
    m.rollback("a", 2)
    assert len(m.block_tables["a"].block_hashes) == 1
    assert m.allocator.get_cached_block(h1) == 1  # content intact until a write
    m.append_slots("a", [60])
    assert m.allocator.get_cached_block(h1) is None and m.allocator.block_hashes[1] is None
    m.append_slots("a", [70])  # full again, new content, registered under its new hash
    assert m.allocator.get_cached_block(hash_block_chain([0, 1, 2, 3, 4, 5, 60, 70], 4)[1]) == 1


def test_rollback_into_block_someone_hit_copies_on_write():
    m = BlockSpaceManager(8, 4)
    m.allocate("a", list(range(8)))
    m.rollback("a", 2)
    assert m.allocate("b", list(range(8)) + [99]) == 8  # block 1 still holds 0..7's KV: a valid hit
    assert m.append_slots("a", [60]) == [(1, m.get_block_table("a")[1])]
    assert m.get_block_table("a")[1] != 1 and m.allocator.ref_count(1) == 1


# --- running out, bad input -------------------------------------------------------------------
def test_out_of_blocks_raises_and_changes_nothing():
    m = BlockSpaceManager(2, 4)
    m.allocate("a", list(range(8)))
    before = snapshot(m)
    assert m.can_allocate([1]) is AllocStatus.LATER and not m.can_allocate([1])
    with pytest.raises(NoFreeBlocks):
        m.allocate("b", [1])
    assert not m.can_append_slots("a")
    with pytest.raises(NoFreeBlocks):
        m.append_slots("a", [8])
    assert snapshot(m) == before and "b" not in m
    assert m.can_allocate(list(range(9))) is AllocStatus.NEVER
    with pytest.raises(ValueError, match="needs 3 blocks of 4; the whole pool has 2"):
        m.allocate("b", list(range(9)))
    assert snapshot(m) == before


def test_copy_on_write_without_free_block_raises_and_changes_nothing():
    m = BlockSpaceManager(2, 4)
    m.allocate("a", list(range(6)))
    m.fork("a", "b")
    before = snapshot(m)
    with pytest.raises(NoFreeBlocks, match="needs 1 free blocks for 1 new tokens"):
        m.append_slots("a", [6])
    assert snapshot(m) == before
    m.free("b")
    assert m.append_slots("a", [6]) == []


def test_cache_hits_revived_from_evictable_count_against_free_blocks():
    m = BlockSpaceManager(3, 2)
    m.allocate("a", [1, 2, 3])  # block 0 cached, block 1
    m.free("a")  # free: 2, 1; evictable: 0
    m.allocate("c", [7])  # takes block 2
    prompt = [1, 2, 9, 9, 9]  # hits block 0, needs 2 more: 3 free blocks in all, only 2 are free
    assert m.can_allocate(prompt) is AllocStatus.LATER
    before = snapshot(m)
    with pytest.raises(NoFreeBlocks):
        m.allocate("b", prompt)
    assert snapshot(m) == before
    m.free("c")
    assert m.can_allocate(prompt) and m.allocate("b", prompt) == 2


def test_bad_input():
    m = BlockSpaceManager(4, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockSpaceManager(4, 3)
    with pytest.raises(ValueError, match="prompt_token_ids is empty"):
        m.allocate("a", [])
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\] is 1.5"):
        m.allocate("a", [1, 1.5])
    with pytest.raises(ValueError, match=r"prompt_token_ids\[0\] is -1"):
        m.allocate("a", [-1])
    assert m.allocate("a", torch.tensor([3, 4])) == 0 and m.block_tables["a"].token_ids == [3, 4]
    with pytest.raises(ValueError, match="already has a block table"):
        m.allocate("a", [1])
    m.free("a")
    with pytest.raises(KeyError, match="already freed"):
        m.free("a")
    with pytest.raises(KeyError, match="'zz' has no block table"):
        m.append_slots("zz", [1])
    assert m.num_free_blocks == 4


# --- random schedules -------------------------------------------------------------------------
TOKENS = st.integers(0, 2)  # a tiny vocabulary, so sequences often share content
BASES = [[0, 1, 2, 0, 1, 2, 0, 1], [0, 1, 2, 0, 2, 2, 1, 0], [1, 1, 1, 1, 1, 1, 1, 1]]
# Prompts start with a prefix of a few shared texts, so the prefix cache hits often.
PROMPTS = st.builds(lambda base, n, tail: base[:n] + tail,
                    st.sampled_from(BASES), st.integers(0, 8), st.lists(TOKENS, max_size=3)).filter(len)


class PagedCacheMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / rollback / free against a simulated pool.

    The pool maps slot -> the tokens whose KV that slot encodes (the token at that position and all
    before it, since K and V depend on the whole prefix). We play the model's part: write the slots
    each call reserves and perform the copy-on-write copies it returns. Then every live sequence
    must read its own prefix at every position: nothing it relies on was overwritten, and every
    prefix-cache hit served the right KV.
    """

    @initialize(num_blocks=st.integers(3, 16), block_size=st.sampled_from([1, 2, 4, 4]), caching=st.booleans())
    def setup(self, num_blocks, block_size, caching):
        self.m = BlockSpaceManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.bs = block_size
        self.pool: dict[int, tuple[int, ...]] = {}
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0

    def write(self, seq, start, n):
        for pos, slot in zip(range(start, start + n), self.m.slot_mapping(seq, start, n)):
            self.pool[slot] = tuple(self.tokens[seq][:pos + 1])

    def pick(self, i):
        return sorted(self.tokens)[i % len(self.tokens)]

    @precondition(lambda self: len(self.tokens) < 4)  # keep a few alive, so the pool is not always full
    @rule(prompt=PROMPTS)
    def allocate(self, prompt):
        seq, self.next_id = self.next_id, self.next_id + 1
        status, before = self.m.can_allocate(prompt), snapshot(self.m)
        try:
            computed = self.m.allocate(seq, prompt)
        except NoFreeBlocks:
            assert status is AllocStatus.LATER and snapshot(self.m) == before
            return
        except ValueError:
            assert status is AllocStatus.NEVER and snapshot(self.m) == before
            return
        assert status is AllocStatus.OK
        assert 0 <= computed < len(prompt) and computed % self.bs == 0
        self.tokens[seq] = list(prompt)
        for pos, slot in enumerate(self.m.slot_mapping(seq, 0, computed)):  # cache hits hold our KV
            assert self.pool[slot] == tuple(prompt[:pos + 1])
        self.write(seq, computed, len(prompt) - computed)

    def append_and_write(self, seq, new) -> bool:
        """append_slots, then do what the pool would: the copy-on-write copies, then the writes."""
        can, before = self.m.can_append_slots(seq, len(new)), snapshot(self.m)
        try:
            copies = self.m.append_slots(seq, new)
        except NoFreeBlocks:
            assert not can and snapshot(self.m) == before
            return False
        assert can and len(copies) <= 1
        for src, dst in copies:
            for off in range(self.bs):
                if src * self.bs + off in self.pool:
                    self.pool[dst * self.bs + off] = self.pool[src * self.bs + off]
        start = len(self.tokens[seq])
        self.tokens[seq] += new
        self.write(seq, start, len(new))
        return True

    def rollback_tokens(self, seq, n):
        n = min(n, len(self.tokens[seq]) - 1)
        self.m.rollback(seq, n)
        del self.tokens[seq][len(self.tokens[seq]) - n:]

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 99), new=st.lists(TOKENS, max_size=3))
    def append(self, i, new):
        self.append_and_write(self.pick(i), new)

    @precondition(lambda self: 0 < len(self.tokens) < 6)
    @rule(i=st.integers(0, 99))
    def fork(self, i):
        parent = self.pick(i)
        child, self.next_id = self.next_id, self.next_id + 1
        self.m.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 99), n=st.integers(0, 5))
    def rollback(self, i, n):
        self.rollback_tokens(self.pick(i), n)

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 99), drafts=st.lists(TOKENS, min_size=1, max_size=4), rejected=st.integers(0, 4),
          bonus=TOKENS)
    def speculate(self, i, drafts, rejected, bonus):
        """One speculative step: slots for the drafts, roll back the rejected ones, then the bonus
        token the target model samples, written right after the rollback."""
        seq = self.pick(i)
        if self.append_and_write(seq, drafts):
            self.rollback_tokens(seq, rejected)
            self.append_and_write(seq, [bonus])

    @precondition(lambda self: self.tokens)
    @rule(i=st.integers(0, 99))
    def free(self, i):
        seq = self.pick(i)
        self.m.free(seq)
        del self.tokens[seq]

    @invariant()
    def no_leaks(self):
        a = self.m.allocator
        used = {b for b in range(a.num_blocks) if a.ref_counts[b] > 0}
        free, evictable = set(a.free_block_ids), set(a.evictable)
        assert len(free) == len(a.free_block_ids) and not free & evictable and not (free | evictable) & used
        assert a.num_free_blocks + len(used) == a.num_blocks
        assert (free | evictable | used) == set(range(a.num_blocks))

    @invariant()
    def ref_counts_equal_holders(self):
        a = self.m.allocator
        holders = Counter()
        for table in self.m.block_tables.values():
            assert len(set(table.block_ids)) == len(table.block_ids)
            assert len(table.block_ids) == -(-table.num_tokens // self.bs)
            check_block_table(table.block_ids, a.num_blocks)
            holders.update(table.block_ids)
        assert all(a.ref_counts[b] == holders[b] for b in range(a.num_blocks))

    @invariant()
    def every_sequence_reads_its_own_kv(self):
        assert self.tokens.keys() == self.m.block_tables.keys()
        owners = defaultdict(list)
        for seq, tokens in self.tokens.items():
            assert self.m.block_tables[seq].token_ids == tokens
            for pos, slot in enumerate(self.m.slot_mapping(seq, 0, len(tokens))):
                assert self.pool[slot] == tuple(tokens[:pos + 1]), f"seq {seq} position {pos} was overwritten"
                owners[slot].append(seq)
        # A slot owned by two live sequences lives in a shared block (ref > 1) that holds the same KV
        # for both, checked above: it is shared read-only.
        for slot, seqs in owners.items():
            if len(seqs) > 1:
                assert self.m.allocator.ref_counts[slot // self.bs] >= len(seqs)

    @invariant()
    def cached_blocks_hold_what_their_hash_names(self):
        a = self.m.allocator
        for block_hash, b in a.cached_block_ids.items():
            assert a.block_hashes[b] == block_hash
            prefix = self.pool[b * self.bs + self.bs - 1]  # the block's last slot names the whole prefix
            assert len(prefix) % self.bs == 0 and hash_block_chain(prefix, self.bs)[-1] == block_hash
            for off in range(self.bs):
                assert self.pool[b * self.bs + off] == prefix[:len(prefix) - self.bs + off + 1]
        for b in range(a.num_blocks):
            assert (a.block_hashes[b] is not None) == (b in a.cached_block_ids.values())


PagedCacheMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
test_random_schedules = PagedCacheMachine.TestCase
