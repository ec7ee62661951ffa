"""Per-sequence block tables and the operations a scheduler performs on them.

A sequence's KV lives in fixed-size blocks scattered through the pool. Its KVCacheBlocks lists them
in order: logical block i (positions i*block_size .. (i+1)*block_size-1) lives in physical block
block_ids[i]. A token at position p is written to

    slot = block_ids[p // block_size] * block_size + p % block_size

which is a row of the pool viewed as [num_blocks * block_size, num_kv_heads, head_dim].

The manager owns blocks, never tokens. A sequence's token ids and block hashes live in its
Sequence (radarlab.kvcache.sequence; the engine's Request is one), which every method takes and
reads, as vLLM v1's KVCacheManager (vllm/v1/core/kv_cache_manager.py) reads its Request, and never
changes them. Its names are v1's where v1 has the operation: get_computed_blocks, allocate_slots
(slots for a step's next tokens, drafts as lookahead), free, over a BlockPool. Where radarlab keeps
its own, it says why: admission is allocate (v1 folds it into allocate_slots with the computed blocks
passed in; here it also answers whether the whole prompt fits, can_allocate, because the scheduler
errors out a request that never can), copy-on-write pairs come back from allocate_slots (v1 has no
fork: it has no parallel sampling by block sharing), and rollback_slots frees a draft model's own
slots after a rejection.

Allocation follows vLLM 0.32's v1 scheduler:
- admission needs room for the whole sequence (scheduler_reserve_full_isl, on by default), so a
  long prompt is not admitted only to stall halfway through its chunks;
- but blocks are taken only for the tokens a step will compute (KVCacheManager.allocate_slots with
  num_new_tokens): a prompt prefilled in chunks holds the blocks of the chunks done so far.

Contract with the pool: every call reserves slots for the next tokens, and the caller writes their
K/V in the next forward pass. Blocks that become full are registered in the prefix cache when they
are reserved, as vLLM does; since only the tokens of this step are reserved, every registered block
is written by the end of the step. Copy-on-write pairs returned by allocate_slots must be copied
before that forward pass writes.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Hashable, Sequence as SequenceType

import torch

from radarlab.kvcache.block_pool import BlockPool, NoFreeBlocks, PrefixCacheStats
from radarlab.kvcache.block_table import block_table_tensor, compute_slot_mapping
from radarlab.kvcache.sequence import Sequence
from radarlab.util import cdiv, require_int

SeqId = Hashable


@dataclass
class KVCacheBlocks:
    """One sequence's physical blocks in logical order: the scheduler side's list, as vLLM's
    KVCacheBlocks (the worker side's tensor is block_table_tensor's output). Positions
    0..num_slots-1 have slots; the first num_cached_blocks blocks have been offered to the prefix
    cache."""
    block_size: int
    block_ids: list[int] = field(default_factory=list)
    num_slots: int = 0
    num_cached_blocks: int = 0

    def slot(self, pos: int) -> int:
        if not 0 <= pos < self.num_slots:
            raise ValueError(f"position {pos} has no slot; the sequence has slots for {self.num_slots} "
                             "tokens")
        return self.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def check_positions(self, start_pos: int, num_tokens: int) -> None:
        """ValueError unless positions start_pos .. start_pos+num_tokens-1 all have slots."""
        if num_tokens < 0 or start_pos < 0 or start_pos + num_tokens > self.num_slots:
            raise ValueError(f"positions {start_pos}..{start_pos + num_tokens - 1} are outside the "
                             f"{self.num_slots} positions that have slots")

    def slot_mapping(self, start_pos: int, num_tokens: int) -> list[int]:
        """Slots of positions start_pos .. start_pos+num_tokens-1."""
        self.check_positions(start_pos, num_tokens)
        return [self.slot(p) for p in range(start_pos, start_pos + num_tokens)]

    def copy(self) -> "KVCacheBlocks":
        return KVCacheBlocks(self.block_size, list(self.block_ids), self.num_slots, self.num_cached_blocks)


class AllocStatus(enum.Enum):
    """Answer of can_allocate. Truthy only for OK, so `if manager.can_allocate(seq):` reads naturally.

    NEVER means the sequence needs more blocks than the whole pool: waiting would hang, so reject it.
    """
    OK = "ok"
    LATER = "later"
    NEVER = "never"

    def __bool__(self) -> bool:
        return self is AllocStatus.OK


class KVCacheManager:
    """Block tables of all live sequences over one BlockPool.

    block_pool_cls makes the pool, called as block_pool_cls(num_blocks, block_size, enable_prefix_caching):
    BlockPool, or a class of a learner's own with its methods (notebook 03 runs the engine on one)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 block_pool_cls: type[BlockPool] = BlockPool) -> None:
        self.block_pool = block_pool_cls(num_blocks, block_size, enable_prefix_caching)
        self.block_size = block_size
        self.block_tables: dict[SeqId, KVCacheBlocks] = {}

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.block_pool.prefix_cache_stats

    def __contains__(self, seq) -> bool:
        return _seq_id(seq) in self.block_tables

    # --- admission ------------------------------------------------------------------------------
    def get_computed_blocks(self, seq: Sequence) -> tuple[list[int], int]:
        """The longest run of the sequence's full blocks found in the prefix cache, and the tokens
        they hold. Takes no block and counts no query (a sequence seen for the first time gets this
        manager's block size, which hashes its full blocks).

        The block holding the last token never hits, so at least that token is computed and the
        step still yields logits (vLLM does the same; with a block-aligned, fully cached prompt the
        whole last block is recomputed).
        """
        if not self.block_pool.enable_prefix_caching:
            return [], 0
        seq.bind_block_size(self.block_size)
        hashes = seq.block_hashes[:(seq.num_tokens - 1) // self.block_size]
        hit = self.block_pool.find_longest_cache_hit(hashes)
        return hit, len(hit) * self.block_size

    def can_allocate(self, seq: Sequence, watermark_blocks: int = 0) -> AllocStatus:
        """Could the whole sequence (prompt, and outputs so far after a preemption) have blocks now,
        leaving watermark_blocks free for the requests already running (vLLM's watermark)?"""
        num_required = cdiv(seq.num_tokens, self.block_size)
        if num_required > self.num_blocks:
            return AllocStatus.NEVER
        hit, _ = self.get_computed_blocks(seq)
        needed = self._blocks_to_take(num_required, hit) + watermark_blocks
        return AllocStatus.OK if needed <= self.num_free_blocks else AllocStatus.LATER

    def allocate(self, seq: Sequence, num_new_tokens: int | None = None) -> int:
        """Admit a sequence: adopt its prefix-cache hit, then reserve slots for the next num_new_tokens
        tokens (default: all the rest). Returns num_computed_tokens, the tokens served by the cache.

        The whole sequence must fit now (vLLM's scheduler_reserve_full_isl), although only the first
        chunk gets blocks. Raises NoFreeBlocks (nothing changed) if the pool is short now, ValueError
        if it always will be.
        """
        if seq.seq_id in self.block_tables:
            raise ValueError(f"sequence {seq.seq_id!r} already has a block table")
        num_required = cdiv(seq.num_tokens, self.block_size)
        if num_required > self.num_blocks:
            raise ValueError(f"sequence {seq.seq_id!r} of {seq.num_tokens} tokens needs {num_required} "
                             f"blocks of {self.block_size}; the whole pool has {self.num_blocks}")
        hit, num_computed = self.get_computed_blocks(seq)
        num_to_take = self._blocks_to_take(num_required, hit)
        if num_to_take > self.num_free_blocks:
            raise NoFreeBlocks(f"sequence {seq.seq_id!r} of {seq.num_tokens} tokens needs {num_to_take} free "
                               f"blocks, {self.num_free_blocks} are free")
        remaining = seq.num_tokens - num_computed
        num_new = remaining if num_new_tokens is None else require_int("num_new_tokens",
                                                                       num_new_tokens, 1, remaining)
        num_slots = num_computed + num_new
        for block_id in hit:
            self.block_pool.incref(block_id)
        new_blocks = self.block_pool.allocate_many(cdiv(num_slots, self.block_size) - len(hit))
        table = KVCacheBlocks(self.block_size, hit + new_blocks, num_slots, len(hit))
        self.block_tables[seq.seq_id] = table
        self._cache_full_blocks(seq, table)
        if self.block_pool.enable_prefix_caching:
            self.prefix_cache_stats.record(seq.num_tokens, num_computed)
        return num_computed

    # --- growing ----------------------------------------------------------------------------------
    def can_allocate_slots(self, seq: Sequence, num_new_tokens: int = 1) -> bool:
        return self._append_cost(self._table(seq), num_new_tokens) <= self.num_free_blocks

    def allocate_slots(self, seq: Sequence, num_new_tokens: int = 1, num_lookahead_tokens: int = 0
                     ) -> list[tuple[int, int]]:
        """Reserve slots for the sequence's next num_new_tokens tokens: one for a decode step, a chunk
        for a prompt prefilled in chunks, 1 + k for a speculative verify step. The tokens must be in the
        sequence, except up to num_lookahead_tokens past its end: the drafts, which live beside it
        (vLLM's lookahead slots; their blocks are never offered to the prefix cache for them).

        Returns copy-on-write pairs (src_block, dst_block): the partly filled last block was shared
        (a fork), so the sequence now owns a private copy, and the pool must copy src to dst before
        writing. Raises NoFreeBlocks (nothing changed) if the pool is short.
        """
        table = self._table(seq)
        num_new = require_int("num_new_tokens", num_new_tokens, 0)
        lookahead = require_int("num_lookahead_tokens", num_lookahead_tokens, 0)
        if num_new and table.num_slots + num_new > seq.num_tokens + lookahead:
            raise ValueError(f"sequence {seq.seq_id!r} holds {seq.num_tokens} tokens (+{lookahead} "
                             f"lookahead), {table.num_slots} with slots; it has no tokens for {num_new} more "
                             f"slots (append the tokens first)")
        num_to_take = self._append_cost(table, num_new)
        if num_to_take > self.num_free_blocks:
            raise NoFreeBlocks(f"sequence {seq.seq_id!r} needs {num_to_take} free blocks for {num_new} new "
                               f"tokens, {self.num_free_blocks} are free")
        # slots a rejected draft left may hold the next tokens: blocks they fill are cached now
        if not num_new:
            self._cache_full_blocks(seq, table)
            return []
        copies = []
        if table.num_slots % self.block_size:  # the next token lands in the last block
            last = table.block_ids[-1]
            if self.block_pool.ref_count(last) > 1:  # shared: write into a private copy
                copy = self.block_pool.allocate()
                self.block_pool.free(last)
                table.block_ids[-1] = copy
                copies.append((last, copy))
            elif self.block_pool.block_hashes[last] is not None:
                # Ours alone, but still cached from before a rollback_slots: its content is about to change.
                self.block_pool.uncache_block(last)
        num_new_blocks = cdiv(table.num_slots + num_new, self.block_size) - len(table.block_ids)
        table.block_ids += self.block_pool.allocate_many(num_new_blocks)
        table.num_slots += num_new
        self._cache_full_blocks(seq, table)
        return copies

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent (parallel sampling, n > 1); no KV is copied
        until one of them writes into a shared block. The child's tokens must start with the ones the
        parent has slots for."""
        if child.seq_id in self.block_tables:
            raise ValueError(f"sequence {child.seq_id!r} already has a block table")
        table = self._table(parent).copy()
        if child.all_token_ids[:table.num_slots] != parent.all_token_ids[:table.num_slots]:
            raise ValueError(f"sequence {child.seq_id!r} does not start with the {table.num_slots} tokens "
                             f"that {parent.seq_id!r} has slots for, so it cannot share its blocks")
        child.bind_block_size(self.block_size)
        for block_id in table.block_ids:
            self.block_pool.incref(block_id)
        self.block_tables[child.seq_id] = table

    def rollback_slots(self, seq: Sequence, num_slots: int) -> None:
        """Keep slots for the sequence's first num_slots positions only; blocks left empty are freed.
        The caller has already dropped the tokens (a draft model's own copy of a sequence, after its
        drafts were rejected); the engine's target requests keep their slots instead, as vLLM does.
        A block left partly filled keeps its content until the next allocate_slots writes into it
        (then it is copied if shared, or uncached if cached).
        """
        table = self._table(seq)
        num_slots = require_int("num_slots", num_slots, 0)
        if num_slots > table.num_slots:
            raise ValueError(f"sequence {seq.seq_id!r} has slots for {table.num_slots} positions; "
                             f"it cannot keep {num_slots}")
        num_kept = cdiv(num_slots, self.block_size)
        for block_id in reversed(table.block_ids[num_kept:]):
            self.block_pool.free(block_id)
        del table.block_ids[num_kept:]
        table.num_slots = num_slots
        table.num_cached_blocks = min(table.num_cached_blocks, num_slots // self.block_size)

    def free(self, seq, num_computed_tokens: int | None = None) -> None:
        """Release a finished or preempted sequence (or its id). Blocks are freed tail first, so under
        LRU the tail is evicted before the shared prefix other prompts are likelier to reuse.

        A sequence cut short before its reserved tokens were computed (aborted or preempted with a
        step scheduled but not run) passes num_computed_tokens: its private blocks past that point
        are dropped from the cache, so nobody hits their garbage."""
        seq_id = _seq_id(seq)
        table = self.block_tables.get(seq_id)
        if table is None:
            raise KeyError(f"sequence {seq_id!r} has no block table (never allocated, or already freed)")
        if num_computed_tokens is not None:
            for block_id in table.block_ids[num_computed_tokens // self.block_size:]:
                if self.block_pool.ref_count(block_id) == 1:
                    self.block_pool.uncache_block(block_id)
        del self.block_tables[seq_id]
        for block_id in reversed(table.block_ids):
            self.block_pool.free(block_id)

    # --- what the pool and attention read -----------------------------------------------------
    def get_block_table(self, seq) -> list[int]:
        return list(self._table(seq).block_ids)

    def num_slots(self, seq) -> int:
        """Leading positions of the sequence that have slots."""
        return self._table(seq).num_slots

    def slot_mapping(self, seq, start_pos: int, num_tokens: int) -> list[int]:
        """slot = block_id * block_size + offset for positions start_pos .. start_pos+num_tokens-1."""
        return self._table(seq).slot_mapping(start_pos, num_tokens)

    def block_table_tensor(self, seqs: SequenceType, max_blocks: int | None = None, pad: int = -1,
                           device: str | torch.device | None = None) -> torch.Tensor:
        """int32 [B, max_blocks] block tables of the sequences (or ids), row b padded with `pad` (-1 by
        default, never a block id: radarlab.kvcache.block_table.block_table_tensor says why)."""
        tables = [self._table(s).block_ids for s in seqs]
        width = max((len(t) for t in tables), default=0) if max_blocks is None else max_blocks
        for seq, block_ids in zip(seqs, tables):
            if len(block_ids) > width:
                raise ValueError(f"sequence {_seq_id(seq)!r} has {len(block_ids)} "
                                 f"blocks; max_blocks is {width}")
        return block_table_tensor(tables, width, pad, device)

    def slot_mapping_tensor(self, seqs: SequenceType, start_positions: SequenceType[int],
                            query_lens: SequenceType[int], pad_to: int | None = None,
                            device: str | torch.device | None = None) -> torch.Tensor:
        """int64 [T] slots of every new token in the packed batch (sequence b's query_lens[b] tokens
        from start_positions[b]), then -1 up to pad_to. The KV write skips -1 (vLLM's convention)."""
        if not len(seqs) == len(start_positions) == len(query_lens):
            raise ValueError(f"seqs, start_positions and query_lens differ in length: "
                             f"{len(seqs)}, {len(start_positions)}, {len(query_lens)}")
        tables = [self._table(s) for s in seqs]
        for table, start, n in zip(tables, start_positions, query_lens):
            table.check_positions(start, n)
        num_tokens = sum(query_lens)
        if pad_to is not None and pad_to < num_tokens:
            raise ValueError(f"pad_to={pad_to} is smaller than the {num_tokens} tokens in the batch")
        lens = torch.tensor(list(query_lens), dtype=torch.long)
        req = torch.repeat_interleave(torch.arange(len(seqs)), lens)
        starts = torch.tensor(list(start_positions), dtype=torch.long)
        positions = torch.arange(num_tokens) - torch.repeat_interleave(lens.cumsum(0) - lens - starts, lens)
        slots = compute_slot_mapping(block_table_tensor([t.block_ids for t in tables]), positions,
                                     self.block_size, req)
        if pad_to is not None:
            slots = torch.cat([slots, slots.new_full((pad_to - num_tokens,), -1)])
        return slots if device is None else slots.to(device)

    # --- helpers --------------------------------------------------------------------------
    def _table(self, seq) -> KVCacheBlocks:
        seq_id = _seq_id(seq)
        table = self.block_tables.get(seq_id)
        if table is None:
            raise KeyError(f"sequence {seq_id!r} has no block table (never allocated, or already freed)")
        return table

    def _blocks_to_take(self, num_required: int, hit: list[int]) -> int:
        """Free blocks a sequence uses up: fresh ones, plus cache hits revived from the evictable set."""
        num_revived = sum(self.block_pool.ref_count(b) == 0 for b in hit)
        return num_required - len(hit) + num_revived

    def _append_cost(self, table: KVCacheBlocks, num_new_tokens: int) -> int:
        num_new_tokens = require_int("num_new_tokens", num_new_tokens, 0)
        if num_new_tokens == 0:
            return 0
        num_new_blocks = cdiv(table.num_slots + num_new_tokens, self.block_size) - len(table.block_ids)
        cow = table.num_slots % self.block_size != 0 and self.block_pool.ref_count(table.block_ids[-1]) > 1
        return num_new_blocks + int(cow)

    def _cache_full_blocks(self, seq: Sequence, table: KVCacheBlocks) -> None:
        """Offer each block that has become full (of this sequence's own tokens) to the prefix cache,
        under the hash the sequence computed for it."""
        if not self.block_pool.enable_prefix_caching:
            return
        num_full = min(table.num_slots, seq.num_tokens) // self.block_size
        hashes = seq.block_hashes
        for i in range(table.num_cached_blocks, num_full):
            self.block_pool.cache_full_block(table.block_ids[i], hashes[i])
        table.num_cached_blocks = max(table.num_cached_blocks, num_full)


def _seq_id(seq) -> SeqId:
    return seq.seq_id if isinstance(seq, Sequence) else seq
