"""The checkers of notebook 03: a correct solution passes, and typical mistakes get a plain counterexample."""
from __future__ import annotations

from collections import deque

import pytest

from radarlab.checks import check_append_with_cow, check_ref_count_allocator, check_slot_mapping
from radarlab.kvcache.block_pool import NoFreeBlocks


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
