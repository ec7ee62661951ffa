"""The checkers of notebook 03: a correct solution passes, and typical mistakes get a plain counterexample."""
from __future__ import annotations

from collections import deque

import pytest

from radarlab.checks import (
    check_append_with_cow,
    check_block_pool,
    check_ref_count_allocator,
    check_slot_mapping,
)
from radarlab.kvcache.block_pool import BlockPool, NoFreeBlocks


def slot_mapping(block_table, block_size, start, n):
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]


def _positions(block_table, block_size, start, n):
    return list(range(start, start + n))


def _no_multiply(block_table, block_size, start, n):
    return [block_table[p // block_size] + p % block_size for p in range(start, start + n)]


def _from_zero(block_table, block_size, start, n):
    return slot_mapping(block_table, block_size, 0, n)


def test_slot_mapping_solution_passes(verdict):
    verdict(check_slot_mapping, slot_mapping)


@pytest.mark.parametrize("fn,message", [
    (_positions, "returned [0, 1, 2], expected [28, 29, 30] (those are the positions"),
    (_no_multiply, "it returned [7, 8, 9], expected [28, 29, 30] (slot = block_table[p // block_size] * "
                   "block_size"),
    (_from_zero, "start=5, n=1 (one decode step) it returned [8], expected [21]"),
])
def test_slot_mapping_mistakes(verdict, fn, message):
    verdict(check_slot_mapping, fn, message)


class Allocator:
    def __init__(self, num_blocks):
        self.free_list = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    def allocate(self):
        if not self.free_list:
            raise NoFreeBlocks("no free blocks")
        block_id = self.free_list.popleft()
        self.ref_counts[block_id] = 1
        return block_id

    def incref(self, block_id):
        self.ref_counts[block_id] += 1

    def free(self, block_id):
        if self.ref_counts[block_id] == 0:
            raise ValueError(f"double free of block {block_id}")
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            self.free_list.append(block_id)


class _FreesShared(Allocator):  # returns a block to the free list while another holder still has it
    def free(self, block_id):
        if self.ref_counts[block_id] == 0:
            raise ValueError("double free")
        self.ref_counts[block_id] -= 1
        self.free_list.append(block_id)


class _NoDoubleFreeCheck(Allocator):
    def free(self, block_id):
        self.ref_counts[block_id] = max(0, self.ref_counts[block_id] - 1)
        if self.ref_counts[block_id] == 0 and block_id not in self.free_list:
            self.free_list.append(block_id)


class _Lifo(Allocator):  # takes the most recently freed block
    def allocate(self):
        if not self.free_list:
            raise NoFreeBlocks("empty")
        block_id = self.free_list.pop()
        self.ref_counts[block_id] = 1
        return block_id


class _IndexErrorWhenEmpty(Allocator):
    def allocate(self):
        block_id = self.free_list.popleft()
        self.ref_counts[block_id] = 1
        return block_id


class _Stub(Allocator):
    def allocate(self):
        raise NotImplementedError()


def test_allocator_solution_passes(verdict):
    verdict(check_ref_count_allocator, Allocator)


@pytest.mark.parametrize("cls,message", [
    (_Stub, "allocate is not written yet"),
    (_FreesShared, "incref(1), free(1) (one holder of the shared block lets go): free_list is [3, 1], "
                   "expected [3]"),
    (_NoDoubleFreeCheck, "free(1) (block 1 is already free: a double free) returned None; expected it to "
                         "raise ValueError"),
    (_Lifo, "on a fresh pool of 4 blocks, allocate() returned 3; expected it to return 0"),
    (_IndexErrorWhenEmpty, "allocate() (the free list is empty) raised IndexError: pop from an empty deque; "
                           "expected it to raise NoFreeBlocks"),
])
def test_allocator_mistakes(verdict, cls, message):
    verdict(check_ref_count_allocator, cls, message)


# --- append_with_cow ---------------------------------------------------------------------------------
def append_with_cow(allocator, block_ids, num_slots, num_new, block_size):
    shared = num_slots % block_size != 0 and allocator.ref_count(block_ids[-1]) > 1
    num_new_blocks = -(-(num_slots + num_new) // block_size) - len(block_ids)
    if num_new_blocks + shared > allocator.num_free_blocks:
        raise NoFreeBlocks(f"need {num_new_blocks + shared} blocks")
    block_ids, copies = list(block_ids), []
    if shared:
        private = allocator.allocate()
        allocator.free(block_ids[-1])
        copies.append((block_ids[-1], private))
        block_ids[-1] = private
    return block_ids + allocator.allocate_many(num_new_blocks), copies


def _no_copy(allocator, block_ids, num_slots, num_new, block_size):
    num_new_blocks = -(-(num_slots + num_new) // block_size) - len(block_ids)
    return list(block_ids) + allocator.allocate_many(num_new_blocks), []


def _copy_unshared(allocator, block_ids, num_slots, num_new, block_size):  # copies any partly filled block
    ref_count = allocator.ref_count
    allocator.ref_count = lambda block_id: 2
    try:
        return append_with_cow(allocator, block_ids, num_slots, num_new, block_size)
    finally:
        allocator.ref_count = ref_count


# forgets the "partly filled" test
def _copy_full_shared(allocator, block_ids, num_slots, num_new, block_size):
    if allocator.ref_count(block_ids[-1]) > 1 and num_slots % block_size == 0:
        private = allocator.allocate()
        allocator.free(block_ids[-1])
        block_ids, copies = block_ids[:-1] + [private], [(block_ids[-1], private)]
        num_new_blocks = -(-(num_slots + num_new) // block_size) - len(block_ids)
        return block_ids + allocator.allocate_many(num_new_blocks), copies
    return append_with_cow(allocator, block_ids, num_slots, num_new, block_size)


def _take_then_check(allocator, block_ids, num_slots, num_new, block_size):  # the copy before counting
    block_ids, copies = list(block_ids), []
    if num_slots % block_size and allocator.ref_count(block_ids[-1]) > 1:
        private = allocator.allocate()
        allocator.free(block_ids[-1])
        copies.append((block_ids[-1], private))
        block_ids[-1] = private
    num_new_blocks = -(-(num_slots + num_new) // block_size) - len(block_ids)
    return block_ids + allocator.allocate_many(num_new_blocks), copies


def _floor_blocks(allocator, block_ids, num_slots, num_new, block_size):  # rounds the block count down
    block_ids, copies = list(block_ids), []
    num_new_blocks = (num_slots + num_new) // block_size - len(block_ids)
    return block_ids + allocator.allocate_many(max(0, num_new_blocks)), copies


def _one_block_too_many(allocator, block_ids, num_slots, num_new, block_size):
    num_new_blocks = (num_slots + num_new) // block_size + 1 - len(block_ids)
    return list(block_ids) + allocator.allocate_many(num_new_blocks), []


def test_append_with_cow_solution_passes(verdict):
    verdict(check_append_with_cow, append_with_cow)


@pytest.mark.parametrize("fn,message", [
    (_no_copy, "for a sequence with 6 tokens in blocks [0, 1] (block size 4, their ref counts [2, 2]), 6 "
               "blocks free, appending 1 token it returned blocks [0, 1] and copies []; expected [0, 2] and "
               "[(1, 2)] (block 1 is partly filled and shared (ref count 2): take a private copy"),
    (_copy_unshared, "for a sequence with 3 tokens in blocks [0] (block size 4, their ref counts [1]), 7 "
                     "blocks free, appending 1 token it returned blocks [1] and copies [(0, 1)]; expected "
                     "[0] and [] (block 0 is not shared (ref count 1): write into it, no copy)"),
    (_copy_full_shared, "8 tokens in blocks [0, 1] (block size 4, their ref counts [2, 2]), 6 blocks free, "
                        "appending 1 token it returned blocks [0, 2, 3] and copies [(1, 2)]; expected [0, "
                        "1, 2] and [] (the last block is full (8 is a multiple of 4)"),
    (_take_then_check, "6 tokens in blocks [0, 1] (block size 4, their ref counts [2, 2]), 1 block free, "
                       "appending 3 tokens it raised NoFreeBlocks (right: it needs 2 blocks) but changed "
                       "things first: ref counts [2, 1, 1, 1] (before: [2, 2, 1, 0]); free list [] (before: "
                       "[3]). Count what you need"),
    (_floor_blocks, "4 tokens in blocks [0] (block size 4, their ref counts [1]), 7 blocks free, appending "
                    "1 token it returned blocks [0] and copies []; expected [0, 1] and [] (4 + 1 tokens "
                    "need cdiv(5, 4) = 2 blocks)"),
    (_one_block_too_many, "3 tokens in blocks [0] (block size 4, their ref counts [1]), 7 blocks free, "
                          "appending 1 token it returned blocks [0, 1] and copies []; expected [0] and [] "
                          "(3 + 1 tokens need cdiv(4, 4) = 1 block)"),
])
def test_append_with_cow_mistakes(verdict, fn, message):
    verdict(check_append_with_cow, fn, message)


# --- slot_mapping: off-by-one positions ------------------------------------------------------------
def _one_position_late(block_table, block_size, start, n):  # maps positions start + 1 .. start + n
    return slot_mapping(block_table, block_size, start + 1, n)


def _one_position_early(block_table, block_size, start, n):  # maps start - 1 ..: the last computed token
    return slot_mapping(block_table, block_size, max(0, start - 1), n)


@pytest.mark.parametrize("fn,message", [
    (_one_position_late, "start=0, n=3 (one block) it returned [29, 30, 31], expected [28, 29, 30] (slot = "
                         "block_table[p // block_size] * block_size + p % block_size)"),
    (_one_position_early, "start=5, n=1 (one decode step) it returned [20], expected [21]"),
])
def test_slot_mapping_off_by_one(verdict, fn, message):
    verdict(check_slot_mapping, fn, message)


# --- block_pool (the main exercise): BlockPool's five methods written again on its own state -----------

class Pool(BlockPool):
    """A learner's solution: BlockPool's state and helpers, the five methods of the exercise rewritten
    (which block a fresh allocation takes is _take, so that a mistake can change just that)."""

    def allocate_many(self, n):
        if n > self.num_free_blocks:
            raise NoFreeBlocks(f"need {n}, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block_id = self._take()
            self.ref_counts[block_id] = 1
            out.append(block_id)
        return out

    def _take(self):
        if self.free_block_ids:
            return self.free_block_ids.popleft()
        block_id, _ = self.evictable.popitem(last=False)
        self._drop_hash(block_id)
        return block_id

    def incref(self, block_id):
        if self.ref_counts[block_id] == 0:
            if block_id not in self.evictable:
                raise ValueError(f"block {block_id} is free")
            del self.evictable[block_id]
        self.ref_counts[block_id] += 1

    def free(self, block_id):
        if self.ref_counts[block_id] == 0:
            raise ValueError(f"double free of {block_id}")
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            if self.block_hashes[block_id] is None:
                self.free_block_ids.append(block_id)
            else:
                self.evictable[block_id] = None

    def find_longest_cache_hit(self, block_hashes):
        hit = []
        for h in block_hashes:
            if h not in self.cached_block_ids:
                break
            hit.append(self.cached_block_ids[h])
        return hit

    def cache_full_block(self, block_id, block_hash):
        if block_hash in self.cached_block_ids:
            return False
        self.block_hashes[block_id] = block_hash
        self.cached_block_ids[block_hash] = block_id
        return True


class _FreeForgetsCache(Pool):  # a freed block always returns to the free list, its content forgotten
    def free(self, block_id):
        super().free(block_id)
        if block_id in self.evictable:
            del self.evictable[block_id]
            self._drop_hash(block_id)
            self.free_block_ids.append(block_id)


class _EvictsNewest(Pool):  # evicts the most recently freed cached block
    def _take(self):
        if self.free_block_ids:
            return self.free_block_ids.popleft()
        self.evictable.move_to_end(next(reversed(self.evictable)), last=False)
        return super()._take()


class _IncrefLeavesEvictable(Pool):  # a revived block stays in the evictable set: it could be handed out
    def incref(self, block_id):
        if self.ref_counts[block_id] == 0 and block_id not in self.evictable:
            raise ValueError(f"block {block_id} is free")
        self.ref_counts[block_id] += 1


class _SkipsMisses(Pool):  # keeps looking after a miss
    def find_longest_cache_hit(self, block_hashes):
        return [self.cached_block_ids[h] for h in block_hashes if h in self.cached_block_ids]


class _EvictsFirst(Pool):  # takes a cached free block before a never-cached one
    def _take(self):
        if not self.evictable:
            return self.free_block_ids.popleft()
        free, self.free_block_ids = self.free_block_ids, deque()
        block_id = super()._take()
        self.free_block_ids = free
        return block_id


class _Partial(Pool):  # takes what there is before finding out it is not enough
    def allocate_many(self, n):
        taken = super().allocate_many(min(n, self.num_free_blocks))
        if len(taken) < n:
            raise NoFreeBlocks("short")
        return taken


class _KeepsEvictedHash(Pool):  # evicts a block but leaves its hash pointing at it
    def _drop_hash(self, block_id):
        pass


class _RecachesDuplicate(Pool):  # a second block with the same content replaces the cached one
    def cache_full_block(self, block_id, block_hash):
        self.block_hashes[block_id] = block_hash
        self.cached_block_ids[block_hash] = block_id
        return True


def test_block_pool_solution_passes(verdict):
    verdict(check_block_pool, Pool)


def test_block_pool_passes_radarlabs_own(verdict):
    verdict(check_block_pool, BlockPool)


@pytest.mark.parametrize("cls,message", [
    (_FreeForgetsCache, "a freed block that holds cached content stays findable"),
    (_EvictsNewest, "evict the least recently freed cached block (2, freed before 1)"),
    (_IncrefLeavesEvictable, "num_free_blocks is 5, expected 4 (a prefix-cache hit on a free cached block "
                             "revives it"),
    (_SkipsMisses, "find_longest_cache_hit(['A', 'X', 'C']) returned [0, 2], expected [0] (stop at the first "
                   "miss"),
    (_EvictsFirst, "never-cached free blocks go first"),
    (_Partial, "raise NoFreeBlocks before taking any (all or nothing)"),
    (_KeepsEvictedHash, "and forget its hash"),
    (_RecachesDuplicate, "the first one stays the cached one, and this call returns False"),
])
def test_block_pool_mistakes(verdict, cls, message):
    verdict(check_block_pool, cls, message)


def test_block_pool_class_that_cannot_be_made(verdict):
    class NeedsMore(Pool):
        def __init__(self, num_blocks):
            super().__init__(num_blocks, 4)

    verdict(check_block_pool, NeedsMore, "creating it as pool_cls(num_blocks=5, block_size=4, "
                                         "enable_prefix_caching=True) raised TypeError")
