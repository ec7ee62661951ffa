"""KV caches: the memory calculator, the contiguous baseline, and the paged cache with its block bookkeeping."""
from radarlab.kvcache.block_table import AllocStatus, BlockSpaceManager, BlockTable
from radarlab.kvcache.blocks import BlockAllocator, NoFreeBlocks
from radarlab.kvcache.contiguous import ContiguousKVCache, KVCacheFull
from radarlab.kvcache.paged_cache import PagedKVCache

__all__ = [
    "AllocStatus",
    "BlockAllocator",
    "BlockSpaceManager",
    "BlockTable",
    "ContiguousKVCache",
    "KVCacheFull",
    "NoFreeBlocks",
    "PagedKVCache",
]
