"""The quantized Triton kernels against their torch references (interpreter, small shapes): the write
stores the very bytes reshape_and_cache stores; attention equals paged_attention_torch over the pools."""
from __future__ import annotations

import pytest
import torch

from radarlab.attention.metadata import AttentionMetadata
from radarlab.attention.torch_paged import paged_attention_torch
from radarlab.attention.triton_quant import triton_quant_paged_attention, triton_quant_reshape_and_cache
from radarlab.kvcache.paged_cache import PagedKVCache, reshape_and_cache

FORMATS = ["fp8", "fp8_e5m2", "fp8_e4m3_rtz", "fp8_per_token_head", "int4_g16_sym", "int4_g8",
           "int4_g16_asym_fp8scales", "int4_g32_sym_fp8scales"]
H, D, BLOCK = 2, 32, 4


def _x(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _caches(name, **kw):
    return [PagedKVCache(1, 8, H, D, block_size=BLOCK, kv_cache_dtype=name, **kw) for _ in range(2)]


@pytest.mark.parametrize("name", FORMATS)
def test_write_stores_the_same_bytes_as_torch(name):
    kw = {"k_scale": 0.02, "v_scale": torch.tensor([0.5])} if name in ("fp8", "fp8_e5m2") else {}
    ours, ref = _caches(name, **kw)
    k, v = _x(7, H, D, seed=1) * 4, _x(7, H, D, seed=2)
    k[0, 0, :3] = torch.tensor([1e6, -1e6, 0.0])  # saturates
    slots = torch.tensor([3, 9, -1, 0, 17, 30, 31])
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
    cache.write(0, _x(n, H, D, seed=3) * 2, _x(n, H, D, seed=4), torch.tensor(slots))
    bt = torch.tensor([t + [-1] * (3 - len(t)) for t in tables])
    meta = AttentionMetadata.from_lens(news, totals, block_tables=bt)
    q = _x(sum(news), 4, D, seed=5)
    k_pool, v_pool = cache.layer_pools(0)
    got = triton_quant_paged_attention(q, k_pool, v_pool, bt, meta.seq_lens, meta.query_start_loc, 0.2)
    want = paged_attention_torch(q, k_pool, v_pool, bt, meta.seq_lens, meta.query_start_loc, 0.2)
    assert torch.allclose(got, want, atol=2e-5)


def test_triton_cache_backend_matches_torch_backend():
    outs = []
    for backend in ("torch", "triton"):
        cache = PagedKVCache(1, 6, H, D, block_size=BLOCK, kv_cache_dtype="int4_g16_hadamard", backend=backend)
        meta = AttentionMetadata.from_lens([5], [5], slot_mapping=torch.tensor([8, 9, 10, 11, 12]),
                                           block_tables=torch.tensor([[2, 3]]))
        outs.append(cache.attend(0, _x(5, 4, D, seed=6), _x(5, H, D, seed=7), _x(5, H, D, seed=8), meta, 0.2))
    assert torch.allclose(outs[0], outs[1], atol=2e-5)


def test_vllm_form_of_triton_reshape_and_cache():
    """Raw uint8 pools with vLLM's kv_cache_dtype / k_scale / v_scale: the same bytes as the torch op."""
    from radarlab.attention.triton_paged import triton_reshape_and_cache

    pools = [torch.zeros(3, BLOCK, H, D, dtype=torch.uint8) for _ in range(4)]
    k, v = _x(5, H, D, seed=9) * 50, _x(5, H, D, seed=10)
    slots = torch.tensor([0, 1, -1, 8, 9])
    triton_reshape_and_cache(k, v, pools[0], pools[1], slots, kv_cache_dtype="fp8_e5m2", k_scale=2.0, v_scale=0.25)
    reshape_and_cache(k, v, pools[2], pools[3], slots, "fp8_e5m2", k_scale=2.0, v_scale=0.25)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3]) and pools[0].any()
    with pytest.raises(ValueError, match="fp8 scale is per tensor"):
        triton_reshape_and_cache(k, v, pools[0], pools[1], slots, kv_cache_dtype="fp8", k_scale=torch.ones(3))


def test_kernels_refuse_plain_pools():
    cache = PagedKVCache(1, 2, H, D, block_size=BLOCK)
    with pytest.raises(ValueError, match="take QuantizedPool pools"):
        triton_quant_reshape_and_cache(_x(1, H, D, seed=0), _x(1, H, D, seed=0), cache.k[0], cache.v[0],
                                       torch.tensor([0]))
