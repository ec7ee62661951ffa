"""Attention backends: how one layer writes its new K/V into the paged cache and attends over it.

The cache (radarlab.kvcache) is storage only; a backend is the code that reads and writes it, as
vLLM's attention backends are (vllm/v1/attention/backends/). Each has two steps:
- build(meta, kv_cache): once per step, before any layer. It validates the step's metadata against
  the pool (block tables, slot mapping), moves it to the pool's device and adds what the backend
  plans per step (the SDPA plan; KIVI's and the sinks' plan of which groups a step writes). vLLM's
  AttentionMetadataBuilder.build.
- forward(layer, q, k, v, meta, kv_cache, scale): once per layer: write K/V at meta.slot_mapping,
  attend over meta.block_tables. vLLM's AttentionImpl.forward.

Which configuration runs which code (get_attn_backend picks; Engine(backend=..., kv_cache_dtype=...,
cpu_ops=...) and PagedKVCache(...) decide):

Each configuration, then its backend; its KV write; its attention:

- backend="torch", 16/32-bit, C++ ops built: CpuBackend; torch.ops.radarlab.reshape_and_cache;
  decodes and chunks of at most sdpa_paged.KERNEL_MAX_QUERIES queries (verify steps):
  cpu_decode.paged_decode_cpu (check=False; the C++ paged_decode), longer chunks: sdpa_paged. The
  engine's replayed step (models/replay.py) calls the same two through CpuBackend's write_pools and
  attend_pools
- backend="torch", 16/32-bit, no C++ ops: TorchSDPABackend; kv_write.reshape_and_cache;
  sdpa_paged.paged_attention_sdpa
- backend="triton", 16/32-bit: TritonBackend; triton_paged.triton_reshape_and_cache;
  triton_paged.triton_paged_attention
- backend="torch", any quantized dtype: QuantizedTorchBackend; kv_write.reshape_and_cache (KIVI:
  KiviStore.write); torch_paged.paged_attention_torch over QuantizedPool views
- backend="triton", any quantized dtype: QuantizedTritonBackend; triton_quant.triton_quant_reshape_and_cache
  (KIVI: triton_kivi_quantize_groups); triton_quant.triton_quant_paged_attention
- ContiguousKVCache (notebook 02, generate.py): ContiguousBackend, whose per-layer step is a
  constructor argument (default contiguous_attn.contiguous_attention); contiguous.append_to_row;
  reference.attention_reference

The reference math (reference.py) and torch_paged.py's split-KV decode are what the kernels are
tested against (tests, radarlab.lab.kernel_bench); the Triton split-KV decode runs there and in
notebook 04, not in an engine configuration.
"""
from __future__ import annotations

from radarlab.attention.backends.contiguous_attn import ContiguousBackend
from radarlab.attention.backends.quant_attn import QuantizedTorchBackend, QuantizedTritonBackend
from radarlab.attention.backends.sdpa_attn import CpuBackend, TorchSDPABackend
from radarlab.attention.backends.triton_attn import TritonBackend
from radarlab.attention.layout import validate_slot_mapping
from radarlab.attention.metadata import AttentionMetadata
from radarlab.kvcache.contiguous import ContiguousKVCache
from radarlab.kvcache.paged_cache import PagedKVCache

BACKENDS = {"contiguous": ContiguousBackend(), "torch_sdpa": TorchSDPABackend(), "cpu": CpuBackend(),
            "triton": TritonBackend(), "quantized_torch": QuantizedTorchBackend(),
            "quantized_triton": QuantizedTritonBackend()}


def get_attn_backend(kv_cache):
    """The backend that runs this cache's configuration (the list above)."""
    if isinstance(kv_cache, ContiguousKVCache):
        return BACKENDS["contiguous"]
    if not isinstance(kv_cache, PagedKVCache):
        raise TypeError(f"kv_cache must be a PagedKVCache or ContiguousKVCache, got "
                        f"{type(kv_cache).__name__}")
    if kv_cache.kv_format.is_quantized:
        return BACKENDS["quantized_triton" if kv_cache.backend == "triton" else "quantized_torch"]
    if kv_cache.backend == "triton":
        return BACKENDS["triton"]
    return BACKENDS["cpu" if kv_cache.cpu_ops else "torch_sdpa"]


def build_metadata(kv_cache, meta: AttentionMetadata, backend=None) -> AttentionMetadata:
    """Once per step: the metadata every layer of this step reads, built by `backend` (default: the
    one get_attn_backend picks for the cache). Every layer then runs that backend: the seam where
    a backend of one's own (a subclass, or any object with is_built, build and forward) plugs in."""
    backend = get_attn_backend(kv_cache) if backend is None else backend
    return backend.build(meta, kv_cache)


def backend_of(kv_cache, meta: AttentionMetadata):
    """The backend that runs meta on this cache: one of one's own that built it, else radarlab's for
    the cache's settings (metadata built for another cache is built again, by the right one)."""
    if meta.backend is None or meta.backend in BACKENDS.values():
        return get_attn_backend(kv_cache)
    return meta.backend


def ensure_built(kv_cache, meta: AttentionMetadata) -> AttentionMetadata:
    """meta as this cache's backend builds it, built now if it was not: once per forward pass, so
    layers never build (the model calls this; the model runner has built it already)."""
    backend = backend_of(kv_cache, meta)
    return meta if backend.is_built(meta, kv_cache) else backend.build(meta, kv_cache)


def attention_forward(kv_cache, layer: int, q, k, v, meta: AttentionMetadata, scale: float):
    """One layer: write this step's K/V, attend, with the backend that built meta. Metadata built for
    another pool, or never built, is built here (checked again), except for formats whose write is
    planned per step (KIVI, sinks), which must be built once per step, before layer 0."""
    backend = backend_of(kv_cache, meta)
    if not backend.is_built(meta, kv_cache):
        meta = backend.build(meta, kv_cache, layer)
    return backend.forward(layer, q, k, v, meta, kv_cache, scale)


def write_kv(kv_cache, layer: int, k, v, slot_mapping) -> None:
    """Store k, v [T, kv_heads, D] of one layer at slot_mapping [T] (-1 = padding), outside a step's
    attention (tests, the comparison of cache layouts with vLLM's). Checked here, every call."""
    if kv_cache.kivi is not None or kv_cache.sinks is not None:
        raise ValueError(f"a {kv_cache.kv_format.name} cache is written by attention_forward: which groups a "
                         f"write quantizes, and which tokens are a sequence's sink, depend on the step's "
                         f"block tables and sequence lengths")
    kv_cache.check_kv(layer, k, v)
    slot_mapping = slot_mapping.to(kv_cache.k.device)
    validate_slot_mapping(slot_mapping, k.shape[0], kv_cache.num_slots)
    get_attn_backend(kv_cache).write_slots(layer, k, v, slot_mapping, kv_cache)
