"""The contiguous baseline (notebook 02): each sequence's row, appended to, then the reference math."""
from __future__ import annotations

from dataclasses import replace

import torch

from radarlab.attention.metadata import AttentionMetadata
from radarlab.attention.reference import attention_reference
from radarlab.kvcache.contiguous import KVCacheFull, append_to_row


class ContiguousBackend:
    def is_built(self, meta: AttentionMetadata, kv_cache) -> bool:
        return meta.backend is self

    def build(self, meta: AttentionMetadata, kv_cache, layer: int | None = None) -> AttentionMetadata:
        if meta.cache_rows is None:
            raise ValueError("ContiguousKVCache needs AttentionMetadata.cache_rows")
        return replace(meta, backend=self)

    def forward(self, layer: int, q, k, v, meta: AttentionMetadata, kv_cache, scale: float) -> torch.Tensor:
        """Write this step's K/V into each sequence's row, then attend over the row's prefix."""
        out = torch.empty_like(q)
        bounds = meta.query_start_loc.tolist()
        for b, (row, seq_len) in enumerate(zip(meta.cache_rows.tolist(), meta.seq_lens.tolist())):
            if seq_len > kv_cache.max_len:
                raise KVCacheFull(f"sequence {b} needs {seq_len} positions; the cache "
                                  f"row holds {kv_cache.max_len}")
            lo, hi = bounds[b], bounds[b + 1]
            keys, values = append_to_row(kv_cache.k[layer], kv_cache.v[layer], row, seq_len, k[lo:hi],
                                         v[lo:hi])
            out[lo:hi] = attention_reference(q[lo:hi], keys, values, scale)
        return out
