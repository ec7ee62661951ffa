"""Backends for quantized caches (FP8, INT4, KIVI, rotations, sinks): the write quantizes, attention
dequantizes only the blocks a step reads. KIVI and the sinks plan each step's writes once, in build."""
from __future__ import annotations

from radarlab.attention.backends.paged_attn import PagedBackend
from radarlab.attention.kv_write import reshape_and_cache
from radarlab.attention.metadata import AttentionMetadata
from radarlab.attention.torch_paged import paged_attention_torch


class QuantizedBackend(PagedBackend):
    """The sinks' and KIVI's writes beside the codes; subclasses write the codes and attend."""

    def plan_step(self, meta: AttentionMetadata, kv_cache, layer: int | None) -> AttentionMetadata:
        stores = [s for s in (kv_cache.kivi, kv_cache.sinks) if s is not None]
        if stores and layer not in (None, 0):
            raise ValueError(f"a {kv_cache.kv_format.name} cache plans each step's writes "
                             "before layer 0: build the step's metadata once "
                             f"(radarlab.attention.backends.build_metadata) and pass it to every layer")
        if kv_cache.sinks is not None:
            kv_cache.sinks.begin_step(meta.slot_mapping, meta.block_tables, meta.seq_lens,
                                      meta.query_start_loc)
        if kv_cache.kivi is not None:
            kv_cache.kivi.begin_step(meta.slot_mapping, meta.block_tables, meta.seq_lens,
                                     meta.query_start_loc, self.quantize_groups())
        return meta

    def write(self, layer: int, k, v, meta: AttentionMetadata, kv_cache) -> None:
        if kv_cache.sinks is not None:
            kv_cache.sinks.write(layer, k, v)
        if kv_cache.kivi is not None:
            kv_cache.kivi.write(layer, k, v)
        else:
            self.write_slots(layer, k, v, meta.slot_mapping, kv_cache)


class QuantizedTorchBackend(QuantizedBackend):
    def quantize_groups(self):
        return None  # KiviStore's own torch code

    def write_slots(self, layer: int, k, v, slot_mapping, kv_cache) -> None:
        k_pool, v_pool = kv_cache.encoded_pools(layer)
        reshape_and_cache(k, v, k_pool, v_pool, slot_mapping, kv_cache.kv_format)

    def attend(self, layer: int, q, k, v, meta: AttentionMetadata, kv_cache, scale: float):
        self.write(layer, k, v, meta, kv_cache)
        k_pool, v_pool = kv_cache.layer_pools(layer)
        settling = None
        if kv_cache.kivi is not None:  # a query reads what it would have read as the newest token
            fmt, settled = kv_cache.kv_format, kv_cache.kivi.quantized_length
            settling = (*kv_cache.layer_pools(layer, fresh=True),
                        lambda n: settled(n, fmt.group_size, fmt.residual))
        return paged_attention_torch(q, k_pool, v_pool, meta.block_tables, meta.seq_lens,
                                     meta.query_start_loc, scale, check=False, settling=settling)


class QuantizedTritonBackend(QuantizedBackend):
    """fp8_load: a jit function with triton_quant._load_fp8's signature, which loads every FP8 tile of K
    and V in its place (notebook 06 runs the engine on the learner's this way); None: radarlab's."""

    def __init__(self, fp8_load=None) -> None:
        self.fp8_load = fp8_load

    def quantize_groups(self):
        from radarlab.attention.triton_quant import triton_kivi_quantize_groups  # imports triton

        return triton_kivi_quantize_groups

    def write_slots(self, layer: int, k, v, slot_mapping, kv_cache) -> None:
        from radarlab.attention.triton_quant import triton_quant_reshape_and_cache

        k_pool, v_pool = kv_cache.encoded_pools(layer)
        triton_quant_reshape_and_cache(k, v, k_pool, v_pool, slot_mapping, check=False)

    def attend(self, layer: int, q, k, v, meta: AttentionMetadata, kv_cache, scale: float):
        from radarlab.attention.triton_quant import triton_quant_paged_attention

        self.write(layer, k, v, meta, kv_cache)
        # KIVI's pools carry this step's 16-bit groups: the settled-prefix rule
        k_pool, v_pool = kv_cache.layer_pools(layer, fresh=kv_cache.kivi is not None)
        return triton_quant_paged_attention(q, k_pool, v_pool, meta.block_tables, meta.seq_lens,
                                            meta.query_start_loc, scale, check=False, fp8_load=self.fp8_load)
