"""The checkers of notebook 03: a correct solution passes, and typical mistakes get a plain counterexample."""
from __future__ import annotations

from collections import deque

import pytest

from radarlab.checks import check_ref_count_allocator, check_slot_mapping
from radarlab.kvcache.blocks import NoFreeBlocks


def slot_mapping(block_table, block_size, start, n):
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, start + n)]


def _stub(block_table, block_size, start, n):
    raise NotImplementedError()


def _positions(block_table, block_size, start, n):
    return list(range(start, start + n))


def _no_multiply(block_table, block_size, start, n):
    return [block_table[p // block_size] + p % block_size for p in range(start, start + n)]


def _from_zero(block_table, block_size, start, n):
    return slot_mapping(block_table, block_size, 0, n)


def test_slot_mapping_solution_passes(capsys):
    assert check_slot_mapping(slot_mapping) is True
    assert capsys.readouterr().out == "PASS slot_mapping\n"


@pytest.mark.parametrize("fn,message", [
    (_stub, "not written yet"),
    (_positions, "returned [0, 1, 2], expected [28, 29, 30] (those are the positions"),
    (_no_multiply, "it returned [7, 8, 9], expected [28, 29, 30] (slot = block_table[p // block_size] * block_size"),
    (_from_zero, "start=5, n=1 (one decode step) it returned [8], expected [21]"),
])
def test_slot_mapping_mistakes(capsys, fn, message):
    assert check_slot_mapping(fn) is False
    out = capsys.readouterr().out
    assert out.startswith("FAIL slot_mapping: ") and message in out, out


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


def test_allocator_solution_passes(capsys):
    assert check_ref_count_allocator(Allocator) is True
    assert capsys.readouterr().out == "PASS ref_count_allocator\n"


@pytest.mark.parametrize("cls,message", [
    (_Stub, "allocate is not written yet"),
    (_FreesShared, "incref(1), free(1) (one holder of the shared block lets go): free_list is [3, 1], expected [3]"),
    (_NoDoubleFreeCheck, "free(1) (block 1 is already free: a double free) returned None; expected it to raise ValueError"),
    (_Lifo, "on a fresh pool of 4 blocks, allocate() returned 3; expected it to return 0"),
    (_IndexErrorWhenEmpty, "allocate() (the free list is empty) raised IndexError: pop from an empty deque; "
                           "expected it to raise NoFreeBlocks"),
])
def test_allocator_mistakes(capsys, cls, message):
    assert check_ref_count_allocator(cls) is False
    out = capsys.readouterr().out
    assert out.startswith("FAIL ref_count_allocator: ") and message in out, out
