"""The torch backend on 16/32-bit pools: SDPA over gathered rows (sdpa_paged.py), and on a CPU with
radarlab's C++ operators, the decodes in the paged kernel that reads the blocks in place."""
from __future__ import annotations

from dataclasses import replace

from radarlab.attention.backends.paged_attn import PagedBackend
from radarlab.attention.kv_write import reshape_and_cache
from radarlab.attention.metadata import AttentionMetadata
from radarlab.attention.sdpa_paged import paged_attention_sdpa, plan_paged_sdpa
from radarlab.cpu_ops import load_cpu_ops


class TorchSDPABackend(PagedBackend):
    decode_kernel = False  # the decodes go to SDPA too, in length buckets

    def is_built(self, meta: AttentionMetadata, kv_cache) -> bool:
        return super().is_built(meta, kv_cache) and meta.plan is not None

    def plan_step(self, meta: AttentionMetadata, kv_cache, layer: int | None) -> AttentionMetadata:
        if meta.plan is not None:
            return meta
        return replace(meta, plan=plan_paged_sdpa(meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                                  kv_cache.block_size, meta.slot_mapping,
                                                  decode_kernel=self.decode_kernel))

    def write_slots(self, layer: int, k, v, slot_mapping, kv_cache) -> None:
        reshape_and_cache(k, v, kv_cache.k[layer], kv_cache.v[layer], slot_mapping)

    def write_pools(self, k, v, k_pool, v_pool, meta: AttentionMetadata) -> None:
        # the step's plan knows whether any slot is padding, so no layer's write has to look
        reshape_and_cache(k, v, k_pool, v_pool, meta.slot_mapping, padded=meta.plan.padded)

    def attend(self, layer: int, q, k, v, meta: AttentionMetadata, kv_cache, scale: float):
        return self.attend_pools(kv_cache.k[layer], kv_cache.v[layer], q, k, v, meta, scale)

    def attend_pools(self, k_pool, v_pool, q, k, v, meta: AttentionMetadata, scale: float):
        """Write and attend on one layer's pools [num_blocks, block_size, kv_heads, D], passed in (the
        replayed step, radarlab.models.replay, resolves each layer's once)."""
        self.write_pools(k, v, k_pool, v_pool, meta)
        return paged_attention_sdpa(q, k_pool, v_pool, meta.plan, scale)


class CpuBackend(TorchSDPABackend):
    """The C++ operators' write (vLLM's reshape_and_cache) and decode kernel; chunks stay on SDPA."""
    decode_kernel = True

    def write_pools(self, k, v, k_pool, v_pool, meta: AttentionMetadata) -> None:
        load_cpu_ops().reshape_and_cache(k, v, k_pool, v_pool, meta.slot_mapping)
