"""The quantized Triton kernels against their torch references (interpreter, small shapes): the write
stores the very bytes reshape_and_cache stores; attention equals paged_attention_torch over the pools;
a Triton-backend cache (KIVI, sinks, int8 zero points included) equals a torch-backend one step by step."""
from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from radarlab.attention.backends import attention_forward, write_kv
from radarlab.attention.kv_write import reshape_and_cache
from radarlab.attention.metadata import AttentionMetadata
from radarlab.attention.torch_paged import paged_attention_torch
from radarlab.attention.triton_quant import (
    _load_fp8,
    triton_quant_paged_attention,
    triton_quant_reshape_and_cache,
)
from radarlab.device import default_device
from radarlab.kvcache.paged_cache import PagedKVCache

from cache_steps import seeded, step_metadata

FORMATS = ["fp8", "fp8_e5m2", "fp8_e4m3_rtz", "fp8_per_token_head", "int4_g16_sym", "int4_g8",
           "int4_g16_asym_fp8scales", "int4_g32_sym_fp8scales", "int4_g8_int8zeros",
           "int4_g16_fp8scales_int8zeros"]
CACHE_FORMATS = ["kivi_g4", "kivi_g4_r4", "kivi_g8_sink1", "kivi_g4_fp8scales_int8zeros_sink1",
                 "int4_g8_int8zeros", "fp8_e4m3_sink2", "int4_g8_sym_sink1"]
H, D, BLOCK = 2, 32, 4
DEV = default_device()  # "cpu" (the interpreter) here; scripts/gpu_check.sh runs this file compiled on CUDA


def _x(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEV)


def _caches(name, **kw):
    return [PagedKVCache(1, 8, H, D, block_size=BLOCK, kv_cache_dtype=name, device=DEV,
                         **kw) for _ in range(2)]


@pytest.mark.parametrize("name", FORMATS)
def test_write_stores_the_same_bytes_as_torch(name):
    kw = {"k_scale": 0.02, "v_scale": torch.tensor([0.5])} if name in ("fp8", "fp8_e5m2") else {}
    ours, ref = _caches(name, **kw)
    k, v = _x(7, H, D, seed=1) * 4, _x(7, H, D, seed=2)
    k[0, 0, :3] = torch.tensor([1e6, -1e6, 0.0])  # saturates
    slots = torch.tensor([3, 9, -1, 0, 17, 30, 31], device=DEV)
    triton_quant_reshape_and_cache(k, v, *ours.layer_pools(0), slots)
    reshape_and_cache(k, v, *ref.layer_pools(0), slots, name)
    for a, b in zip(ours.block_tensors(), ref.block_tensors()):
        assert torch.equal(a, b)
    assert ours.k.any()


@pytest.mark.parametrize("name", FORMATS)
def test_attention_equals_torch_over_the_same_pools(name):
    cache = _caches(name)[0]
    tables = [[5, 1, 7], [2, 0], [6]]
    totals, news = [11, 6, 3], [1, 3, 3]  # a decode, a chunk of prefill, a whole prefill
    slots = [t[p // BLOCK] * BLOCK + p % BLOCK for t, total in zip(tables, totals) for p in range(total)]
    n = len(slots)
    write_kv(cache, 0, _x(n, H, D, seed=3) * 2, _x(n, H, D, seed=4), torch.tensor(slots, device=DEV))
    bt = torch.tensor([t + [-1] * (3 - len(t)) for t in tables], device=DEV)
    meta = AttentionMetadata.from_lens(news, totals, block_tables=bt).to(DEV)
    q = _x(sum(news), 4, D, seed=5)
    k_pool, v_pool = cache.layer_pools(0)
    got = triton_quant_paged_attention(q, k_pool, v_pool, bt, meta.seq_lens, meta.query_start_loc, 0.2)
    want = paged_attention_torch(q, k_pool, v_pool, bt, meta.seq_lens, meta.query_start_loc, 0.2)
    assert torch.allclose(got, want, atol=2e-5)


def test_triton_cache_backend_matches_torch_backend():
    outs = []
    for backend in ("torch", "triton"):
        cache = PagedKVCache(1, 6, H, D, block_size=BLOCK, kv_cache_dtype="int4_g16_hadamard",
                             backend=backend, device=DEV)
        meta = AttentionMetadata.from_lens([5], [5], slot_mapping=torch.tensor([8, 9, 10, 11, 12]),
                                           block_tables=torch.tensor([[2, 3]])).to(DEV)
        outs.append(attention_forward(cache, 0, _x(5, 4, D, seed=6), _x(5, H, D, seed=7), _x(5, H, D, seed=8),
                                      meta, 0.2))
    assert torch.allclose(outs[0], outs[1], atol=2e-5)


def test_vllm_form_of_triton_reshape_and_cache():
    """Raw uint8 pools with vLLM's kv_cache_dtype / k_scale / v_scale: the same bytes as the torch op."""
    from radarlab.attention.triton_paged import triton_reshape_and_cache

    pools = [torch.zeros(3, BLOCK, H, D, dtype=torch.uint8, device=DEV) for _ in range(4)]
    k, v = _x(5, H, D, seed=9) * 50, _x(5, H, D, seed=10)
    slots = torch.tensor([0, 1, -1, 8, 9], device=DEV)
    triton_reshape_and_cache(k, v, pools[0], pools[1], slots, kv_cache_dtype="fp8_e5m2", k_scale=2.0,
                             v_scale=0.25)
    reshape_and_cache(k, v, pools[2], pools[3], slots, "fp8_e5m2", k_scale=2.0, v_scale=0.25)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3]) and pools[0].any()
    with pytest.raises(ValueError, match="fp8 scale is per tensor"):
        triton_reshape_and_cache(k, v, pools[0], pools[1], slots, kv_cache_dtype="fp8", k_scale=torch.ones(3))


def test_kernels_refuse_plain_pools():
    cache = PagedKVCache(1, 2, H, D, block_size=BLOCK, device=DEV)
    with pytest.raises(ValueError, match="take QuantizedPool pools"):
        triton_quant_reshape_and_cache(_x(1, H, D, seed=0), _x(1, H, D, seed=0), cache.k[0], cache.v[0],
                                       torch.tensor([0], device=DEV))


def _run_steps(name, backend):
    """Two sequences through a prefill, a chunked prefill beside a decode, then decodes: every output,
    and the cache afterwards."""
    T = 22
    q, k, v = (seeded(2 * T, n, D, seed=s, half_exact=True).to(DEV) for n, s in ((4, 11), (H, 12), (H, 13)))
    k[:, :, 3] += 9  # an outlier channel, as real keys have
    tables, block = [[2, 5, 0], [1, 4]], 8  # kivi_g8 needs groups of 8 inside a block
    cache = PagedKVCache(1, 6, H, D, block_size=block, kv_cache_dtype=name, backend=backend, num_sinks=4,
                         device=DEV)
    outs, done = [], [0, 0]
    for news in ([13, 5], [1, 6], *[[1, 1]] * 4):
        totals = [d + n for d, n in zip(done, news)]
        rows = torch.cat([torch.arange(d, t) + i * T for i, (d, t) in enumerate(zip(done, totals))]).to(DEV)
        outs.append(attention_forward(cache, 0, q[rows], k[rows], v[rows],
                                      step_metadata(news, totals, tables, block).to(DEV),
                                 0.25))
        done = totals
    return torch.cat(outs), cache


def _state(cache):
    state = cache.block_tensors()
    if cache.kivi is not None:
        state += [cache.kivi.k_tail, cache.kivi.v_tail, cache.kivi.tail_of]
    if cache.sinks is not None:
        state += [cache.sinks.k, cache.sinks.v, cache.sinks.sink_of]
    return state


@pytest.mark.parametrize("name", CACHE_FORMATS)
def test_triton_backend_equals_torch_backend_step_by_step(name):
    want, ref = _run_steps(name, "torch")
    got, ours = _run_steps(name, "triton")
    assert torch.allclose(got, want, atol=2e-5), float((got - want).abs().max())
    for a, b in zip(_state(ours), _state(ref)):
        assert torch.equal(a, b)
    assert ours.k.any()


def test_triton_kivi_prefill_reads_each_group_as_its_query_did():
    """Without this step's 16-bit groups (fresh=False), a prefill query would read key groups that a
    later token of the same prefill completed: the kernel's settled-prefix rule is what keeps it equal
    to the torch path (and so to decoding token by token)."""
    cache = PagedKVCache(1, 8, H, D, block_size=BLOCK, kv_cache_dtype="kivi_g4", backend="triton", device=DEV)
    q, k, v = (seeded(13, n, D, seed=s, half_exact=True).to(DEV) for n, s in ((4, 14), (H, 15), (H, 16)))
    meta = step_metadata([13], [13], [[2, 5, 0, 6]], BLOCK).to(DEV)
    out = attention_forward(cache, 0, q, k, v, meta, 0.25)
    args = (meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.25)
    settled = triton_quant_paged_attention(q, *cache.layer_pools(0, fresh=True), *args)
    unsettled = triton_quant_paged_attention(q, *cache.layer_pools(0), *args)
    want = paged_attention_torch(q, *cache.layer_pools(0), *args)  # the torch path without settling
    assert torch.equal(out, settled)
    assert torch.allclose(unsettled, want, atol=2e-5)
    assert float((settled - unsettled)[:12].abs().max()) > 1e-3  # queries before the last group's end
    assert torch.allclose(settled[12], unsettled[12], atol=2e-5)  # the last query is the newest token


@triton.jit
def _doubled_load(ptr, scales_ptr, static_ptr, table_ptr, block, row, kv_head, d, ok,
                  stride_pb, stride_ps, stride_ph, stride_pd, stride_mb, stride_ms, stride_mh, static_h,
                  TOKEN_SCALE: tl.constexpr):
    return 2.0 * _load_fp8(ptr, scales_ptr, static_ptr, table_ptr, block, row, kv_head, d, ok, stride_pb,
                           stride_ps, stride_ph, stride_pd, stride_mb, stride_ms, stride_mh, static_h,
                           TOKEN_SCALE)


@pytest.mark.parametrize("name", ["fp8", "fp8_per_token_head"])
def test_fp8_load_replaces_the_kernels_own(name):
    """The seam notebook 06 plugs the learner's load into, through the backend (and so the engine): a load
    that doubles every value reads K and V as a pool whose scales are doubled would be read."""
    from radarlab.attention.backends import QuantizedTritonBackend
    from radarlab.quant.kv_codec import QuantizedPool

    kw = {"k_scale": 0.5, "v_scale": 0.25} if name == "fp8" else {}
    cache = PagedKVCache(1, 8, H, D, block_size=BLOCK, kv_cache_dtype=name, backend="triton", device=DEV,
                         **kw)
    backend = QuantizedTritonBackend(fp8_load=_doubled_load)
    meta = backend.build(step_metadata([6], [6], [[3, 1]], BLOCK).to(DEV), cache)
    q, k, v = _x(6, 4, D, seed=17), _x(6, H, D, seed=18), _x(6, H, D, seed=19)
    got = attention_forward(cache, 0, q, k, v, meta, 0.25)
    doubled = [QuantizedPool(p.fmt, p.payload, None if p.scales is None else 2 * p.scales, None,
                             1.0 if p.scale is None else 2 * p.scale, p.head_dim)
               for p in cache.layer_pools(0)]
    args = (meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.25)
    want = paged_attention_torch(q, *doubled, *args)
    assert torch.allclose(got, want, atol=2e-5), float((got - want).abs().max())
    assert torch.equal(triton_quant_paged_attention(q, *cache.layer_pools(0), *args, fp8_load=_load_fp8),
                       triton_quant_paged_attention(q, *cache.layer_pools(0), *args))
