"""KV caches: the memory calculator, the contiguous baseline, and the paged cache with its block
bookkeeping."""
from radarlab.kvcache.block_pool import BlockPool, NoFreeBlocks
from radarlab.kvcache.contiguous import ContiguousKVCache, KVCacheFull
from radarlab.kvcache.kv_cache_manager import AllocStatus, KVCacheBlocks, KVCacheManager
from radarlab.kvcache.paged_cache import PagedKVCache

__all__ = [
    "AllocStatus",
    "BlockPool",
    "KVCacheManager",
    "KVCacheBlocks",
    "ContiguousKVCache",
    "KVCacheFull",
    "NoFreeBlocks",
    "PagedKVCache",
]
