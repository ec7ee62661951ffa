"""KV caches: the memory calculator, the contiguous baseline, and the paged cache."""
from radarlab.kvcache.contiguous import ContiguousKVCache, KVCacheFull

__all__ = ["ContiguousKVCache", "KVCacheFull"]
