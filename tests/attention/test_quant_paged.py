"""Quantized paged caches in torch: the write encodes, attention decodes only the blocks it reads, scales
travel with their blocks, the pool is sized from a byte budget, and the engine runs every format."""
from __future__ import annotations

import pytest
import torch

from radarlab.attention.backends import attention_forward, write_kv
from radarlab.attention.kv_write import reshape_and_cache
from radarlab.attention.reference import attention_reference
from radarlab.attention.torch_paged import paged_decode_torch
from radarlab.kvcache.paged_cache import PagedKVCache, num_blocks_for_budget
from radarlab.models.paged_runner import paged_greedy_generate
from radarlab.quant import fp8
from radarlab.quant.formats import kv_format
from radarlab.quant.kv_codec import QuantizedPool, decode_kv, encode_kv
from radarlab.quant.rotation import rotate, rotation_matrix

from cache_steps import step_metadata

FORMATS = ["fp8", "fp8_e5m2", "fp8_e4m3_rtz", "fp8_per_token_head", "int4_g32_sym", "int4_g64",
           "int4_g16_asym_fp8scales", "int4_g64_sym_hadamard", "fp8_orthogonal"]
H, D, BLOCK = 2, 64, 4


def _x(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _step(lens_new, lens_total, tables, block=BLOCK):
    return step_metadata(lens_new, lens_total, tables, block)


def _expected(fmt, q, k, v, scale=0.125):
    """Attention over K and V as the cache holds them: rotated, encoded, decoded (the reference)."""
    fmt = kv_format(fmt)
    if fmt.rotation:
        r = rotation_matrix(fmt.rotation, D)
        q, k = rotate(q, r), rotate(k, r)
    kd, vd = decode_kv(*encode_kv(k, fmt), fmt), decode_kv(*encode_kv(v, fmt), fmt)
    return attention_reference(q, kd, vd, scale)


@pytest.mark.parametrize("name", FORMATS)
def test_prefill_then_decode_equals_attention_over_the_decoded_kv(name):
    cache = PagedKVCache(2, 8, H, D, block_size=BLOCK, kv_cache_dtype=name)
    q, k, v = _x(11, 4, D, seed=1), _x(11, H, D, seed=2) * 2, _x(11, H, D, seed=3)
    table = [5, 2, 7]
    out = attention_forward(cache, 1, q[:10], k[:10], v[:10], _step([10], [10], [table]), 0.125)
    assert torch.allclose(out, _expected(name, q[:10], k[:10], v[:10]), atol=1e-5)
    # decode reads the same blocks
    out = attention_forward(cache, 1, q[10:], k[10:], v[10:], _step([1], [11], [table]), 0.125)
    assert torch.allclose(out, _expected(name, q, k, v)[10:], atol=1e-5)
    plain = attention_reference(q, k, v, 0.125)
    err = float((out - plain[10:]).abs().max())
    assert 0 < err < 0.5  # quantization changes the output, a little
    assert not cache.k[0].any()  # layer 0 untouched


def test_pool_stores_codes_and_scales_beside_them():
    cache = PagedKVCache(1, 6, H, D, block_size=BLOCK, kv_cache_dtype="int4_g32")
    assert cache.k.dtype == torch.uint8 and cache.k.shape == (1, 6, BLOCK, H, D // 2)
    assert cache.k_scales.shape == cache.k_zeros.shape == (1, 6, BLOCK, H, 2)
    assert cache.k_scales.dtype == torch.float16
    assert cache.nbytes == 6 * PagedKVCache.bytes_per_block(1, H, D, BLOCK, "int4_g32")
    cache = PagedKVCache(1, 6, H, D, block_size=BLOCK, kv_cache_dtype="fp8_per_token_head")
    assert cache.k_scales.shape == (1, 6, BLOCK, H, 1) and cache.k_zeros is None
    cache = PagedKVCache(1, 6, H, D, block_size=BLOCK, kv_cache_dtype="fp8")
    assert cache.k_scales is None and cache.k_scale.shape == (1,)


@pytest.mark.parametrize("name", ["fp8_per_token_head", "int4_g32"])
def test_copy_blocks_copies_codes_and_scales(name):
    cache = PagedKVCache(2, 6, H, D, block_size=BLOCK, kv_cache_dtype=name)
    k, v = _x(4, H, D, seed=4) * 3, _x(4, H, D, seed=5)
    for layer in range(2):
        write_kv(cache, layer, k, v, torch.arange(4) + BLOCK * 1)  # block 1
    cache.copy_blocks([(1, 4)])
    for layer in range(2):
        kp, vp = cache.layer_pools(layer)
        assert torch.equal(kp[torch.tensor([4])], kp[torch.tensor([1])])
        assert torch.equal(vp[torch.tensor([4])], vp[torch.tensor([1])])
        fmt = kv_format(name)
        # the scales came too
        assert torch.equal(kp[torch.tensor([4])][0], decode_kv(*encode_kv(k, fmt), fmt))


def test_vllm_form_of_reshape_and_cache_with_k_scale():
    """Raw uint8 pools and vLLM's arguments: the cache holds encode(k / k_scale)."""
    k_cache = torch.zeros(3, BLOCK, H, D, dtype=torch.uint8)
    v_cache = torch.zeros_like(k_cache)
    k, v = _x(5, H, D, seed=6) * 100, _x(5, H, D, seed=7)
    slots = torch.tensor([0, 1, -1, 8, 9])
    reshape_and_cache(k, v, k_cache, v_cache, slots, "fp8_e4m3", k_scale=2.0, v_scale=0.5)
    keep = slots >= 0
    assert torch.equal(k_cache.view(-1, H, D)[slots[keep]], fp8.encode(k[keep] / 2.0))
    assert torch.equal(v_cache.view(-1, H, D)[slots[keep]], fp8.encode(v[keep] / 0.5))
    # and the torch attention reads them with the same scales
    kp = QuantizedPool(kv_format("fp8"), k_cache, scale=2.0)
    vp = QuantizedPool(kv_format("fp8"), v_cache, scale=0.5)
    q = _x(1, 4, D, seed=8)
    out = paged_decode_torch(q, kp, vp, torch.tensor([[0, 1, 2]]), torch.tensor([2]), 0.1)
    kd = fp8.decode(fp8.encode(k[:2] / 2.0)) * 2.0
    vd = fp8.decode(fp8.encode(v[:2] / 0.5)) * 0.5
    assert torch.allclose(out, attention_reference(q, kd, vd, 0.1), atol=1e-5)


def test_per_head_static_scales_and_bad_scales():
    cache = PagedKVCache(2, 4, H, D, block_size=BLOCK, kv_cache_dtype="fp8")
    k = _x(4, H, D, seed=9)
    k[:, 1] *= 50  # head 1 is larger: a per-head scale keeps head 0's precision
    cache.set_kv_scales(torch.stack([fp8.calibrated_scale(k, rule="head")] * 2), 1.0)
    write_kv(cache, 0, k, k, torch.arange(4))
    back = cache.layer_pools(0)[0][torch.tensor([0])][0]
    assert float((back - k).abs().max()) < float(k.abs().max()) / 8
    with pytest.raises(ValueError, match=r"k_scale must be a number, \[2\] \(per layer\) or \[2, 2\]"):
        cache.set_kv_scales(torch.ones(3), 1.0)
    with pytest.raises(ValueError, match="scale must be finite and > 0"):
        cache.set_kv_scales(1.0, torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="takes none"):
        PagedKVCache(2, 4, H, D, kv_cache_dtype="int4_g32", k_scale=2.0)
    with pytest.raises(ValueError, match=r"group_size \(48\) must divide head_dim \(64\)"):
        PagedKVCache(2, 4, H, D, kv_cache_dtype="int4_g48")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto"):
        PagedKVCache(2, 4, H, D, kv_cache_dtype="nf4")


def test_prefill_chunks_and_mixed_batches_read_blocks_in_place():
    """Two sequences, one in chunked prefill, one decoding: the torch path over QuantizedPools."""
    name = "int4_g32"
    cache = PagedKVCache(1, 10, H, D, block_size=BLOCK, kv_cache_dtype=name)
    ka, va, kb, vb = (_x(9, H, D, seed=s) for s in (10, 11, 12, 13))
    ta, tb = [3, 0, 8], [6, 1]
    write_kv(cache, 0, ka[:6], va[:6], _step([6], [6], [ta]).slot_mapping)
    write_kv(cache, 0, kb[:5], vb[:5], _step([5], [5], [tb]).slot_mapping)
    meta = _step([3, 1], [9, 6], [ta, tb])
    q = _x(4, 4, D, seed=14)
    out = attention_forward(cache, 0, q, torch.cat((ka[6:9], kb[5:6])), torch.cat((va[6:9], vb[5:6])), meta,
                            0.125)
    assert torch.allclose(out[:3], _expected(name, torch.cat((_x(6, 4, D, seed=0), q[:3])), ka, va)[6:],
                          atol=1e-5)
    assert torch.allclose(out[3:],
                          _expected(name, torch.cat((_x(5, 4, D, seed=0), q[3:])), kb[:6], vb[:6])[5:],
                          atol=1e-5)


def test_byte_budget_gives_fp8_twice_the_blocks_of_16_bit():
    args = (30, 3, 64, 16)
    budget = 50 * PagedKVCache.bytes_per_block(*args, "float16")
    assert num_blocks_for_budget(budget, *args, "float16") == 50
    assert num_blocks_for_budget(budget, *args, "fp8") == 100
    assert num_blocks_for_budget(budget, *args, "fp8_per_token_head") == 96  # its scales take room too
    assert num_blocks_for_budget(budget, *args, "int4_g64_sym") == 188  # 16 / 4.25 bits
    assert num_blocks_for_budget(budget, *args, "auto", torch.float32) == 25
    with pytest.raises(ValueError, match="below one block"):
        num_blocks_for_budget(100, *args, "fp8")


@pytest.mark.parametrize("name", ["auto", "fp8", "int4_g8_asym"])
def test_greedy_generate_runs_every_format(tiny_model, name):
    from radarlab.models.generate import greedy_generate

    prompts = [list(range(1, 10)), [5, 6]]
    out = paged_greedy_generate(tiny_model, prompts, 5, block_size=4, kv_cache_dtype=name)
    assert [len(o) for o in out] == [5, 5]
    if name == "auto":  # fp32 greedy is token-identical to the contiguous path
        assert out == greedy_generate(tiny_model, prompts, 5)


def test_engine_sizes_its_pool_from_a_byte_budget(tiny_model):
    from radarlab.engine.llm_engine import Engine
    from radarlab.sample.sampling_params import SamplingParams

    cfg = tiny_model.config
    per = PagedKVCache.bytes_per_block(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4, "float16")
    wide = Engine(tiny_model, None, block_size=4, kv_cache_dtype="float16", kv_cache_bytes=20 * per)
    narrow = Engine(tiny_model, None, block_size=4, kv_cache_dtype="fp8", kv_cache_bytes=20 * per)
    assert wide.manager.num_blocks == 20 and narrow.manager.num_blocks == 40
    assert narrow.cache.nbytes == wide.cache.nbytes
    outs = narrow.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=4))
    assert [len(o.output_token_ids) for o in outs] == [4, 4]
    with pytest.raises(ValueError, match="give num_blocks or kv_cache_bytes"):
        Engine(tiny_model, 10, kv_cache_bytes=per)


@pytest.fixture(scope="module")
def tiny_model(tiny_sharp):
    return tiny_sharp
