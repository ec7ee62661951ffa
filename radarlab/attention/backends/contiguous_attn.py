"""The contiguous baseline (notebook 02): each sequence's row, appended to, then the reference math."""
from __future__ import annotations

from dataclasses import replace

import torch

from radarlab.attention.metadata import AttentionMetadata
from radarlab.attention.reference import attention_reference
from radarlab.kvcache.contiguous import KVCacheFull, append_to_row


def contiguous_attention(q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One layer's step on the contiguous cache. q [T, H, D], k and v [T, Hkv, D] are the step's packed
    tokens; k_cache, v_cache [max_seqs, max_len, Hkv, D] are this layer's rows. Sequence b's tokens
    (query_start_loc[b] .. query_start_loc[b+1]) go to row cache_rows[b] at their positions, then its
    queries attend over the row's first seq_lens[b] positions. Returns [T, H, D]."""
    out = torch.empty_like(q)
    bounds = meta.query_start_loc.tolist()
    for b, (row, seq_len) in enumerate(zip(meta.cache_rows.tolist(), meta.seq_lens.tolist())):
        lo, hi = bounds[b], bounds[b + 1]
        keys, values = append_to_row(k_cache, v_cache, row, seq_len, k[lo:hi], v[lo:hi])
        out[lo:hi] = attention_reference(q[lo:hi], keys, values, scale)
    return out


class ContiguousBackend:
    """`attention` is the per-layer step, contiguous_attention's signature: the seam where notebook 02's
    exercise runs in every layer (build_metadata(cache, meta, backend=ContiguousBackend(mine)))."""

    def __init__(self, attention=contiguous_attention) -> None:
        if not callable(attention):
            raise TypeError(f"attention must be a function like contiguous_attention, got "
                            f"{type(attention).__name__}")
        self.attention = attention

    def is_built(self, meta: AttentionMetadata, kv_cache) -> bool:
        return meta.backend is self

    def build(self, meta: AttentionMetadata, kv_cache, layer: int | None = None) -> AttentionMetadata:
        if meta.cache_rows is None:
            raise ValueError("ContiguousKVCache needs AttentionMetadata.cache_rows")
        for b, seq_len in enumerate(meta.seq_lens.tolist()):
            if seq_len > kv_cache.max_len:
                raise KVCacheFull(f"sequence {b} needs {seq_len} positions; the cache "
                                  f"row holds {kv_cache.max_len}")
        return replace(meta, backend=self)

    def forward(self, layer: int, q, k, v, meta: AttentionMetadata, kv_cache, scale: float) -> torch.Tensor:
        """Write this step's K/V into each sequence's row, then attend over the row's prefix."""
        return self.attention(q, k, v, kv_cache.k[layer], kv_cache.v[layer], meta, scale)
