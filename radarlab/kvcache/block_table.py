"""Per-sequence block tables and the operations a scheduler performs on them.

A sequence's KV lives in fixed-size blocks scattered through the pool. Its BlockTable lists them
in order: logical block i (positions i*block_size .. (i+1)*block_size-1) lives in physical block
block_ids[i]. A token at position p is written to

    slot = block_ids[p // block_size] * block_size + p % block_size

which is a row of the pool viewed as [num_blocks * block_size, num_kv_heads, head_dim].

BlockSpaceManager is named after vLLM's (v0) manager, which owned the same operations: can_allocate,
allocate, can_append_slots, append_slots (returning copy-on-write pairs), fork and free; vLLM v1
calls this role KVCacheManager. We add rollback, which speculative decoding needs.

Contract with the pool: each call reserves slots for the tokens it is given, and the caller writes
their K/V in the next forward pass, before anything reads them. allocate and append_slots register
every block that becomes full in the prefix cache straight away, as vLLM does; the copy-on-write
pairs returned by append_slots must be copied before that forward pass writes.
"""
from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field
from typing import Hashable, Sequence

import torch

from radarlab.util import cdiv
from radarlab.kvcache.blocks import (
    BlockAllocator, BlockHash, NoFreeBlocks, PrefixCacheStats, hash_block_chain, hash_block_tokens,
)

SeqId = Hashable


def check_block_table(block_ids: Sequence[int], num_blocks: int, pad: int | None = None) -> None:
    """ValueError naming the first entry that is not a block of a pool of num_blocks (pad is allowed)."""
    for i, block_id in enumerate(block_ids):
        if block_id == pad:
            continue
        if not 0 <= block_id < num_blocks:
            raise ValueError(f"block table entry {i} is {block_id}, outside the pool (valid ids: 0..{num_blocks - 1})")


@dataclass
class BlockTable:
    """One sequence: its physical blocks in logical order, and the tokens that have slots in them.

    block_hashes holds the chain hash of each full block (only with prefix caching on).
    """
    block_size: int
    block_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    block_hashes: list[BlockHash] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def slot(self, pos: int) -> int:
        if not 0 <= pos < self.num_tokens:
            raise ValueError(f"position {pos} has no slot; the sequence holds {self.num_tokens} tokens")
        return self.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def slot_mapping(self, start_pos: int, num_tokens: int) -> list[int]:
        """Slots of positions start_pos .. start_pos+num_tokens-1."""
        if num_tokens < 0 or start_pos < 0 or start_pos + num_tokens > self.num_tokens:
            raise ValueError(f"positions {start_pos}..{start_pos + num_tokens - 1} are outside the sequence's "
                             f"{self.num_tokens} tokens")
        return [self.slot(p) for p in range(start_pos, start_pos + num_tokens)]

    def copy(self) -> "BlockTable":
        return BlockTable(self.block_size, list(self.block_ids), list(self.token_ids), list(self.block_hashes))


class AllocStatus(enum.Enum):
    """Answer of can_allocate. Truthy only for OK, so `if manager.can_allocate(p):` reads naturally.

    NEVER means the prompt needs more blocks than the whole pool: waiting would hang, so reject it.
    """
    OK = "ok"
    LATER = "later"
    NEVER = "never"

    def __bool__(self) -> bool:
        return self is AllocStatus.OK


class BlockSpaceManager:
    """Block tables of all live sequences over one BlockAllocator."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.allocator = BlockAllocator(num_blocks, block_size, enable_prefix_caching)
        self.block_size = block_size
        self.block_tables: dict[SeqId, BlockTable] = {}

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.allocator.prefix_cache_stats

    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self.block_tables

    # --- prompt -------------------------------------------------------------------------------
    def can_allocate(self, prompt_token_ids: Sequence[int]) -> AllocStatus:
        token_ids = _as_token_ids(prompt_token_ids, "prompt_token_ids")
        num_required = cdiv(len(token_ids), self.block_size)
        if num_required > self.num_blocks:
            return AllocStatus.NEVER
        _, hit = self._cache_hit(token_ids)
        return AllocStatus.OK if self._blocks_to_take(num_required, hit) <= self.num_free_blocks else AllocStatus.LATER

    def allocate(self, seq_id: SeqId, prompt_token_ids: Sequence[int]) -> int:
        """Give a new sequence slots for its whole prompt; return num_computed_tokens, the prompt
        tokens whose KV came from the prefix cache. Compute the rest: slot_mapping(seq_id,
        num_computed_tokens, len(prompt) - num_computed_tokens).

        The block holding the last prompt token is never taken from the cache, so at least that token
        is computed and the prompt still yields logits (vLLM does the same; with a block-aligned, fully
        cached prompt the whole last block is recomputed).
        Raises NoFreeBlocks (nothing changed) if the pool is short now, ValueError if it always will be.
        """
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id!r} already has a block table")
        token_ids = _as_token_ids(prompt_token_ids, "prompt_token_ids")
        num_required = cdiv(len(token_ids), self.block_size)
        if num_required > self.num_blocks:
            raise ValueError(f"prompt of {len(token_ids)} tokens needs {num_required} blocks of {self.block_size}; "
                             f"the whole pool has {self.num_blocks}")
        query_hashes, hit = self._cache_hit(token_ids)  # counted in the stats only once allocate succeeds
        num_to_take = self._blocks_to_take(num_required, hit)
        if num_to_take > self.num_free_blocks:
            raise NoFreeBlocks(f"prompt of {len(token_ids)} tokens needs {num_to_take} free blocks, "
                               f"{self.num_free_blocks} are free")
        for block_id in hit:
            self.allocator.incref(block_id)
        new_blocks = self.allocator.allocate_many(num_required - len(hit))
        table = BlockTable(self.block_size, hit + new_blocks, token_ids, query_hashes[:len(hit)])
        self.block_tables[seq_id] = table
        self._cache_full_blocks(table)
        num_computed_tokens = len(hit) * self.block_size
        self.allocator.prefix_cache_stats.record(len(token_ids), num_computed_tokens, len(query_hashes), len(hit))
        return num_computed_tokens

    # --- decode ---------------------------------------------------------------------------
    def can_append_slots(self, seq_id: SeqId, num_new_tokens: int = 1) -> bool:
        return self._append_cost(self._table(seq_id), num_new_tokens) <= self.num_free_blocks

    def append_slots(self, seq_id: SeqId, new_token_ids: Sequence[int]) -> list[tuple[int, int]]:
        """Reserve slots for new tokens (one per decode step, several for speculative drafts).

        Returns copy-on-write pairs (src_block, dst_block): the sequence's partly filled last block
        was shared (a fork), so it now owns a private copy; the pool must copy src to dst before
        writing the new tokens. Raises NoFreeBlocks (nothing changed) if the pool is short.
        """
        table = self._table(seq_id)
        token_ids = _as_token_ids(new_token_ids, "new_token_ids", allow_empty=True)
        num_to_take = self._append_cost(table, len(token_ids))
        if num_to_take > self.num_free_blocks:
            raise NoFreeBlocks(f"sequence {seq_id!r} needs {num_to_take} free blocks for {len(token_ids)} "
                               f"new tokens, {self.num_free_blocks} are free")
        if not token_ids:
            return []
        copies = []
        if table.num_tokens % self.block_size:  # the next token lands in the last block
            last = table.block_ids[-1]
            if self.allocator.ref_count(last) > 1:  # shared: write into a private copy
                copy = self.allocator.allocate()
                self.allocator.free(last)
                table.block_ids[-1] = copy
                copies.append((last, copy))
            elif self.allocator.block_hashes[last] is not None:
                # Ours alone, but still cached from before a rollback: its content is about to change.
                self.allocator.uncache_block(last)
        num_new_blocks = cdiv(table.num_tokens + len(token_ids), self.block_size) - len(table.block_ids)
        table.block_ids += self.allocator.allocate_many(num_new_blocks)
        table.token_ids += token_ids
        self._cache_full_blocks(table)
        return copies

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """The child shares every block of the parent (parallel sampling, n > 1); no KV is copied
        until one of them writes into a shared block."""
        if child_id in self.block_tables:
            raise ValueError(f"sequence {child_id!r} already has a block table")
        table = self._table(parent_id).copy()
        for block_id in table.block_ids:
            self.allocator.incref(block_id)
        self.block_tables[child_id] = table

    def rollback(self, seq_id: SeqId, num_tokens: int) -> None:
        """Drop the last num_tokens tokens (rejected speculative drafts). Blocks left empty are freed.

        A block left partly filled keeps its content until the next append_slots writes into it
        (then it is copied if shared, or uncached if cached).
        """
        table = self._table(seq_id)
        if not 0 <= num_tokens < table.num_tokens:
            raise ValueError(f"cannot roll back {num_tokens} of sequence {seq_id!r}'s {table.num_tokens} tokens "
                             "(at least one must remain; use free to drop the sequence)")
        new_len = table.num_tokens - num_tokens
        num_kept = cdiv(new_len, self.block_size)
        for block_id in reversed(table.block_ids[num_kept:]):
            self.allocator.free(block_id)
        del table.block_ids[num_kept:]
        del table.token_ids[new_len:]
        del table.block_hashes[new_len // self.block_size:]

    def free(self, seq_id: SeqId, num_computed_tokens: int | None = None) -> None:
        """Release a finished or preempted sequence. Blocks are freed tail first, so under LRU the
        tail is evicted before the shared prefix other prompts are likelier to reuse.

        Full blocks are registered in the prefix cache when they are reserved, before their K/V is
        written. A sequence cut short (aborted or preempted mid-prefill) passes num_computed_tokens:
        its private blocks past that point are dropped from the cache, so nobody hits their garbage."""
        table = self.block_tables.get(seq_id)
        if table is None:
            raise KeyError(f"sequence {seq_id!r} has no block table (never allocated, or already freed)")
        if num_computed_tokens is not None:
            for block_id in table.block_ids[num_computed_tokens // self.block_size:]:
                if self.allocator.ref_count(block_id) == 1:
                    self.allocator.uncache_block(block_id)
        del self.block_tables[seq_id]
        for block_id in reversed(table.block_ids):
            self.allocator.free(block_id)

    # --- what the pool and attention read -----------------------------------------------------
    def get_block_table(self, seq_id: SeqId) -> list[int]:
        return list(self._table(seq_id).block_ids)

    def num_tokens(self, seq_id: SeqId) -> int:
        return self._table(seq_id).num_tokens

    def slot_mapping(self, seq_id: SeqId, start_pos: int, num_tokens: int) -> list[int]:
        """slot = block_id * block_size + offset for positions start_pos .. start_pos+num_tokens-1."""
        return self._table(seq_id).slot_mapping(start_pos, num_tokens)

    def block_table_tensor(self, seq_ids: Sequence[SeqId], max_blocks: int | None = None, pad: int = -1,
                           device: str | torch.device | None = None) -> torch.Tensor:
        """int32 [B, max_blocks] block tables, row b padded with `pad` past its last block.

        The default pad, -1, is never a block id, so a stray read is easy to spot. Kernels must stop
        at cdiv(seq_len, block_size) and never read a pad entry; note torch indexing would wrap -1 to
        the last block silently. vLLM pads with 0 instead; pass pad=0 for that.
        """
        tables = [self._table(s).block_ids for s in seq_ids]
        width = max((len(t) for t in tables), default=0) if max_blocks is None else max_blocks
        out = torch.full((len(tables), width), pad, dtype=torch.int32)
        for row, block_ids in enumerate(tables):
            if len(block_ids) > width:
                raise ValueError(f"sequence {seq_ids[row]!r} has {len(block_ids)} blocks; max_blocks is {width}")
            check_block_table(block_ids, self.num_blocks)
            out[row, :len(block_ids)] = torch.tensor(block_ids, dtype=torch.int32)
        return out.to(device) if device is not None else out

    def slot_mapping_tensor(self, seq_ids: Sequence[SeqId], start_positions: Sequence[int],
                            query_lens: Sequence[int], pad_to: int | None = None,
                            device: str | torch.device | None = None) -> torch.Tensor:
        """int64 [T] slots of every new token in the packed batch (sequence b's query_lens[b] tokens
        from start_positions[b]), then -1 up to pad_to. The KV write skips -1 (vLLM's convention)."""
        if not len(seq_ids) == len(start_positions) == len(query_lens):
            raise ValueError(f"seq_ids, start_positions and query_lens differ in length: "
                             f"{len(seq_ids)}, {len(start_positions)}, {len(query_lens)}")
        slots = [slot for s, start, n in zip(seq_ids, start_positions, query_lens)
                 for slot in self.slot_mapping(s, start, n)]
        if pad_to is not None:
            if pad_to < len(slots):
                raise ValueError(f"pad_to={pad_to} is smaller than the {len(slots)} tokens in the batch")
            slots += [-1] * (pad_to - len(slots))
        out = torch.tensor(slots, dtype=torch.int64)
        return out.to(device) if device is not None else out

    # --- helpers --------------------------------------------------------------------------
    def _table(self, seq_id: SeqId) -> BlockTable:
        table = self.block_tables.get(seq_id)
        if table is None:
            raise KeyError(f"sequence {seq_id!r} has no block table (never allocated, or already freed)")
        return table

    def _cache_hit(self, token_ids: list[int]) -> tuple[list[BlockHash], list[int]]:
        """Hashes of the full blocks before the last prompt token, and the cached blocks for the
        longest prefix of them."""
        if not self.allocator.enable_prefix_caching:
            return [], []
        query_hashes = hash_block_chain(token_ids[:-1], self.block_size)
        return query_hashes, self.allocator.find_longest_cache_hit(query_hashes)

    def _blocks_to_take(self, num_required: int, hit: list[int]) -> int:
        """Free blocks a prompt uses up: fresh ones, plus cache hits revived from the evictable set."""
        num_revived = sum(self.allocator.ref_count(b) == 0 for b in hit)
        return num_required - len(hit) + num_revived

    def _append_cost(self, table: BlockTable, num_new_tokens: int) -> int:
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if num_new_tokens == 0:
            return 0
        num_new_blocks = cdiv(table.num_tokens + num_new_tokens, self.block_size) - len(table.block_ids)
        cow = table.num_tokens % self.block_size != 0 and self.allocator.ref_count(table.block_ids[-1]) > 1
        return num_new_blocks + int(cow)

    def _cache_full_blocks(self, table: BlockTable) -> None:
        """Hash each block that has become full and offer it to the prefix cache."""
        if not self.allocator.enable_prefix_caching:
            return
        for i in range(len(table.block_hashes), table.num_tokens // self.block_size):
            parent = table.block_hashes[-1] if table.block_hashes else None
            tokens = table.token_ids[i * self.block_size:(i + 1) * self.block_size]
            block_hash = hash_block_tokens(parent, tokens)
            table.block_hashes.append(block_hash)
            self.allocator.cache_full_block(table.block_ids[i], block_hash)


def _as_token_ids(token_ids: Sequence[int], name: str, allow_empty: bool = False) -> list[int]:
    """A list of non-negative Python ints (numpy ints and integer tensors' items accepted)."""
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.tolist()
    out = []
    for i, t in enumerate(token_ids):
        try:
            t = operator.index(t)
        except TypeError:
            raise ValueError(f"{name}[{i}] is {t!r}; token ids must be integers") from None
        if t < 0:
            raise ValueError(f"{name}[{i}] is {t}; token ids must be >= 0")
        out.append(t)
    if not out and not allow_empty:
        raise ValueError(f"{name} is empty")
    return out
