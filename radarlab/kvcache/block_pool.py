"""The block pool (vLLM v1's BlockPool, vllm/v1/core/block_pool.py): which physical KV blocks are free,
who shares them, and what they hold.

Pure bookkeeping, no tensors. The pool (radarlab.kvcache.paged_cache) owns K/V shaped
[num_blocks, block_size, num_kv_heads, head_dim] per layer; this module only hands out block ids.

Every block has a reference count: the number of sequences whose block table holds it. Forks and
prefix-cache hits share a block by raising its count; freeing only lowers it, and the block is
reusable when the count reaches zero.

Prefix caching (vLLM's automatic prefix caching). A FULL block is named by a hash chain,
hash(parent block's hash, this block's token ids), so the name covers every token before it too:
two blocks with the same hash hold the same KV. A map hash -> block id finds them. A block that
is freed while it holds cached content keeps its hash and goes to an LRU-ordered "evictable" set:
it counts as free, yet a later prompt with the same prefix can still pick it up. A fresh
allocation takes never-cached free blocks first and evicts the least recently freed cached block
only when none are left.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Sequence

from radarlab.util import is_int, require_int, require_power_of_two

BlockHash = bytes

# The parent of a sequence's first block. Any fixed value works; it just has to differ from a hash.
ROOT_HASH: BlockHash = b"radarlab-prefix-cache-root"


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """sha256 over the parent hash and the token ids packed as little-endian int64.

    Why not Python's hash((parent, tuple(ids)))? It is 64 bits, collisions are easy to construct
    (hash(-1) == hash(-2)), and its value is not promised across Python versions. A collision here
    is silent: a request would attend to another prompt's KV and produce wrong text, no error.
    sha256 makes that practically impossible, and the same tokens give the same hash in every
    process, so notebooks print stable values and caches can be compared across processes
    (vLLM also moved its prefix-cache hash to sha256 for the same reason).
    """
    parent = ROOT_HASH if parent_hash is None else parent_hash
    ids = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.sha256(parent + ids).digest()


def hash_block_chain(token_ids: Sequence[int], block_size: int,
                     parent_hash: BlockHash | None = None) -> list[BlockHash]:
    """Hashes of every full block of token_ids, each chained on the one before."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block_tokens(parent_hash, token_ids[start:start + block_size])
        hashes.append(parent_hash)
    return hashes


class NoFreeBlocks(RuntimeError):
    """The pool has too few free blocks for this request. Nothing was changed: the scheduler can
    catch this, preempt or wait, and retry."""


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters, reported like vLLM's (hit rate = hits / queries, in tokens).

    queries: prompt tokens looked up; hits: of those, tokens served from the cache.
    """
    requests: int = 0
    queries: int = 0
    hits: int = 0

    def record(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hit_tokens

    @property
    def hit_rate(self) -> float:
        """Fraction of queried prompt tokens served from the cache (0.0 before any query)."""
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    """Free list, reference counts and the prefix cache over block ids 0 .. num_blocks-1. vLLM's
    BlockPool has the same parts under other method names (get_new_blocks for allocate_many,
    free_blocks for free, touch for incref, cache_full_blocks for cache_full_block); these are the
    names notebook 03 builds."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        require_int("num_blocks", num_blocks)
        require_power_of_two("block_size", block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks  # content name, if cached
        self.free_block_ids: deque[int] = deque(range(num_blocks))  # free and holding nothing cached
        self.evictable: OrderedDict[int, None] = OrderedDict()  # free but cached; oldest first
        self.cached_block_ids: dict[BlockHash, int] = {}  # hash -> the block holding that content
        self.prefix_cache_stats = PrefixCacheStats()

    # --- counts ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a fresh allocation can take: never-cached free blocks plus evictable ones."""
        return len(self.free_block_ids) + len(self.evictable)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by at least one sequence (ref count > 0)."""
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_block_ids)

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self.ref_counts[block_id]

    # --- allocate and free ----------------------------------------------------------------
    def allocate(self) -> int:
        """One fresh block with ref count 1. Raises NoFreeBlocks (changing nothing) if none is free."""
        return self.allocate_many(1)[0]

    def allocate_many(self, n: int) -> list[int]:
        """n fresh blocks, all or none: NoFreeBlocks is raised before anything changes."""
        if n > self.num_free_blocks:
            raise NoFreeBlocks(f"need {n} free KV blocks, only {self.num_free_blocks} of "
                               f"{self.num_blocks} are free")
        block_ids = []
        for _ in range(n):
            if self.free_block_ids:
                block_id = self.free_block_ids.popleft()
            else:  # evict the least recently freed cached block; its content is forgotten
                block_id, _ = self.evictable.popitem(last=False)
                self._drop_hash(block_id)
            self.ref_counts[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def incref(self, block_id: int) -> None:
        """One more sequence holds this block (a fork, or a prefix-cache hit).

        A cached block with ref count 0 is revived: it leaves the evictable set.
        """
        self._check_id(block_id)
        if self.ref_counts[block_id] == 0:
            if block_id not in self.evictable:
                raise ValueError(f"block {block_id} is free and holds no cached content; allocate it instead")
            del self.evictable[block_id]
        self.ref_counts[block_id] += 1

    def free(self, block_id: int) -> None:
        """One holder lets go. At zero the block is free; if it holds cached content it stays
        findable (evictable, most recently freed last), otherwise it returns to the free list."""
        self._check_id(block_id)
        if self.ref_counts[block_id] == 0:
            raise ValueError(f"double free of block {block_id}: its reference count is already 0")
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            if self.block_hashes[block_id] is not None:
                self.evictable[block_id] = None
            else:
                self.free_block_ids.append(block_id)

    # --- prefix cache ---------------------------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        """The block holding this content, or None. Does not count as a query or touch the block."""
        if not self.enable_prefix_caching:
            return None
        return self.cached_block_ids.get(block_hash)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids for the longest run of block_hashes, from the first, that are all cached.

        The chain makes this a prefix: block i's hash covers blocks 0..i, so stop at the first miss.
        """
        hit = []
        for block_hash in block_hashes:
            block_id = self.get_cached_block(block_hash)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    def cache_full_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a block that just became full under its chain hash. Returns whether it was added.

        If another block already holds this content (two sequences computed the same prefix), the first
        stays the cached one and this block remains private and uncached.
        """
        self._check_id(block_id)
        if not self.enable_prefix_caching or block_hash in self.cached_block_ids:
            return False
        if self.ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is free; only a block in use can be cached")
        if self.block_hashes[block_id] is not None:
            raise ValueError(f"block {block_id} is already cached under another hash")
        self.block_hashes[block_id] = block_hash
        self.cached_block_ids[block_hash] = block_id
        return True

    def uncache_block(self, block_id: int) -> None:
        """Forget a block's cached content because its owner is about to overwrite it."""
        self._check_id(block_id)
        if block_id in self.evictable:
            raise ValueError(f"block {block_id} is free; nobody may write to it")
        self._drop_hash(block_id)

    # --- helpers --------------------------------------------------------------------------
    def _drop_hash(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is not None:
            del self.cached_block_ids[block_hash]
            self.block_hashes[block_id] = None

    def _check_id(self, block_id: int) -> None:
        if not is_int(block_id) or not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id!r} is outside the pool (valid ids: "
                             f"0..{self.num_blocks - 1})")

    def __repr__(self) -> str:
        return (f"BlockPool(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"free={self.num_free_blocks}, cached={self.num_cached_blocks})")
