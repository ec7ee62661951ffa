"""The KV write in torch: one reshape_and_cache entry for every kv_cache_dtype.

vLLM's op has the same name and arguments: the new K/V arrive as [T, kv_heads, D] and are "reshaped"
into blocks at slot_mapping. Attention backends call it (attention/backends); tests and the vLLM
comparisons write through write_kv there.
"""
from __future__ import annotations

from radarlab.quant.formats import KVFormat, kv_format
from radarlab.quant.kv_codec import QuantizedPool


def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, kv_cache_dtype: str | KVFormat = "auto",
                      k_scale=1.0, v_scale=1.0, *, padded: bool = True) -> None:
    """The KV write in torch: token t's k[t], v[t] ([kv_heads, D]) go to slot_mapping[t], -1 skipped.

    Named after vLLM's op (the new K/V arrive as [T, kv_heads, D] and are "reshaped" into blocks),
    with its kv_cache_dtype, k_scale and v_scale: an fp8 cache given as plain uint8 pools stores
    encode(k / k_scale). Formats that keep scales beside the codes are written through QuantizedPool
    pools (PagedKVCache passes them), which carry their own scales. The caller validates the slots;
    padded=False says it also found no -1 among them (once per step), which spares every layer's
    write a check that is a host sync on a GPU.
    """
    slots = slot_mapping.long()
    if padded and bool((slots < 0).any()):
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    fmt = kv_format(kv_cache_dtype)
    # vLLM's form: raw pools and static scales
    if fmt.is_quantized and not isinstance(k_cache, QuantizedPool):
        k_cache, v_cache = (QuantizedPool(fmt, k_cache, scale=k_scale, head_dim=k.shape[-1]),
                            QuantizedPool(fmt, v_cache, scale=v_scale, head_dim=v.shape[-1]))
    if isinstance(k_cache, QuantizedPool):
        k_cache.write(k, slots)
        v_cache.write(v, slots)
        return
    # A pool [num_blocks, block_size, ...] viewed as [num_slots, ...]: slot s is row s.
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v.to(v_cache.dtype)
