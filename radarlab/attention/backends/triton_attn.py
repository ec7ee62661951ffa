"""The Triton backend on 16/32-bit pools: the store-KV kernel, then decode or prefill kernels that
read the blocks in place (triton_paged.py)."""
from __future__ import annotations

from radarlab.attention.backends.paged_attn import PagedBackend
from radarlab.attention.metadata import AttentionMetadata


class TritonBackend(PagedBackend):
    """decode_kernel: a jit function with triton_paged._paged_decode_kernel's signature, launched for
    decode steps in its place (notebook 04 runs the engine on the learner's kernel this way)."""

    def __init__(self, decode_kernel=None) -> None:
        self.decode_kernel = decode_kernel

    def write_slots(self, layer: int, k, v, slot_mapping, kv_cache) -> None:
        from radarlab.attention.triton_paged import triton_reshape_and_cache  # imports triton

        triton_reshape_and_cache(k, v, kv_cache.k[layer], kv_cache.v[layer], slot_mapping, check=False)

    def attend(self, layer: int, q, k, v, meta: AttentionMetadata, kv_cache, scale: float):
        from radarlab.attention.triton_paged import triton_paged_attention  # imports triton

        self.write_slots(layer, k, v, meta.slot_mapping, kv_cache)
        return triton_paged_attention(q, kv_cache.k[layer], kv_cache.v[layer], meta.block_tables,
                                      meta.seq_lens, meta.query_start_loc, scale, check=False,
                                      decode_kernel=self.decode_kernel)
