"""The recipes that reach the perplexity goals, as formats of the paged cache: V rotated with the
output rotated back (vrot), int8 zero points with E4M3 scales (int8zeros), and 16-bit sinks (sink<N>)."""
from __future__ import annotations

import pytest
import torch

from radarlab.attention.backends import attention_forward, write_kv
from radarlab.attention.reference import attention_reference
from radarlab.kvcache.kivi_store import default_tail_groups, tail_bytes
from radarlab.kvcache.memory import kv_footprint
from radarlab.kvcache.paged_cache import PagedKVCache, num_blocks_for_budget
from radarlab.kvcache.sink_store import DEFAULT_SINK_SEQUENCES
from radarlab.quant import fp8, int4, kivi
from radarlab.quant.formats import kv_format

from cache_steps import seeded, step_metadata

H, HQ, D, BLOCK = 2, 4, 16, 8
SCALE = D ** -0.5


def _x(*shape, seed):
    return seeded(*shape, seed=seed, half_exact=True)  # a 16-bit sink stores the reference's numbers


def _meta(news, totals, tables):
    return step_metadata(news, totals, tables, BLOCK)


def _attend(name, q, k, v, backend="torch", table=(3, 0, 5)):
    cache = PagedKVCache(1, 6, H, D, BLOCK, kv_cache_dtype=name, backend=backend)
    return attention_forward(cache, 0, q, k, v, _meta([len(q)], [len(q)], [list(table)]), SCALE), cache


# --- the table -----------------------------------------------------------------------------------
def test_names_and_bits():
    f = kv_format("kivi_g32_int8zeros_fp8scales_sink1")
    assert (f.name, f.int8_zeros, f.scale_dtype, f.sink) == ("kivi_g32_fp8scales_int8zeros_sink1", True,
                                                             "fp8", 1)
    assert f.bits_per_value(64) == 4.5  # 4 + (1 E4M3 scale + 1 int8 zero) * 8 / 32
    # fp16 scale, int8 zero
    assert kv_format("int4_g32_asym_int8zeros").bits_per_value(64) == 4 + (2 + 1) * 8 / 32
    g = kv_format("fp8_vrot_hadamard")
    assert (g.name, g.rotation, g.rotate_values, g.bits_per_value(64)) == ("fp8_e4m3_hadamard_vrot",
                                                                           "hadamard", True, 8)
    assert kv_format("fp32_hadamard_vrot").is_quantized is False  # the exact reference of a rotated format


@pytest.mark.parametrize("name, words", [("fp8_vrot", "add hadamard or orthogonal"),
                                         ("int4_g32_sym_int8zeros", "needs asym"),
                                         ("kivi_sink0", "sink<positive int>"),
                                         ("kivi_sinkx", "sink<positive int>"),
                                         ("fp16_sink1", "unknown option 'sink1'"),
                                         ("fp8_e4m3_int8zeros", "unknown option 'int8zeros'")])
def test_bad_names_raise(name, words):
    with pytest.raises(ValueError, match=words):
        kv_format(name)


def test_sink_bytes_are_per_stream_and_come_out_of_the_budget():
    name = "kivi_g32_fp8scales_int8zeros_sink1"
    sink = 30 * 3 * 64 * 2 * 2  # the course model: one token, K and V, 16-bit, every layer
    assert kv_format(name).sink_bytes_per_stream(30, 3, 64) == sink
    for tokens in (512, 32768):
        with_sink, without = kv_footprint(30, 3, 64, tokens, name), kv_footprint(30, 3, 64, tokens, name[:-6])
        assert with_sink.bytes_per_token == without.bytes_per_token == 30 * 3 * 2 * 64 * 4.5 / 8
        assert with_sink.bytes_per_stream - without.bytes_per_stream == sink  # once, not per token
    per_block = PagedKVCache.bytes_per_block(30, 3, 64, 32, name)
    # 4 open key groups
    tails = tail_bytes(kv_format(name), 30, 3, 64, default_tail_groups(kv_format(name), 4))
    budget = 100 * per_block + tails + 4 * sink
    assert num_blocks_for_budget(budget, 30, 3, 64, 32, name, max_num_seqs=4) == 100
    assert num_blocks_for_budget(budget - 1, 30, 3, 64, 32, name, max_num_seqs=4) == 99
    budget = 100 * per_block + DEFAULT_SINK_SEQUENCES * sink
    assert num_blocks_for_budget(budget, 30, 3, 64, 32, "fp8_e4m3_sink1") == (  # 64 sinks by default
        100 * per_block // PagedKVCache.bytes_per_block(30, 3, 64, 32, "fp8_e4m3"))
    cache = PagedKVCache(2, 5, H, D, BLOCK, kv_cache_dtype="fp8_e4m3_sink2", num_sinks=3)
    assert cache.nbytes == 5 * PagedKVCache.bytes_per_block(2, H, D, BLOCK,
                                                            "fp8_e4m3") + 3 * 2 * 2 * H * D * 2 * 2


# --- int8 zero points ----------------------------------------------------------------------------
@pytest.mark.parametrize("scale_dtype", ["fp16", "fp8"])
def test_int8_zero_points_round_trip_within_half_a_step(scale_dtype):
    x = _x(64, 4, 32, seed=1) * torch.tensor([1.0, 30.0, 0.01, 1.0])[None, :, None]
    x[:, 3] += 100.0  # groups far from zero, narrow against their offset: z must still fit int8
    packed, scales, zeros = int4.quantize(x, 32, symmetric=False, scale_dtype=scale_dtype, int8_zeros=True)
    assert zeros.dtype == torch.int8
    s = int4.load_meta(scales, scale_dtype)[..., 0]
    lo, hi = x.amin(-1), x.amax(-1)
    slack = 1 - 2.0**-10 if scale_dtype == "fp16" else 1.0  # fp16 rounds to nearest, E4M3 scales up
    assert bool((s >= (hi - lo) / 15 * slack).all())  # the range fits in 16 codes
    back = int4.dequantize(packed, scales, zeros, 32, scale_dtype)
    assert bool(((back - x).abs() <= s[..., None] / 2 * (1 + 1e-2) + 1e-6).all())
    assert float((back - x).abs().max()) > 0  # it is lossy


def test_int8_zero_points_put_zero_on_the_grid():
    x = _x(8, 1, 32, seed=2)
    x[..., 5] = 0.0
    packed, scales, zeros = int4.quantize(x, 32, symmetric=False, scale_dtype="fp8", int8_zeros=True)
    assert bool((int4.dequantize(packed, scales, zeros, 32, "fp8")[..., 5] == 0).all())


def test_int8_zeros_with_symmetric_groups_raise():
    with pytest.raises(ValueError, match="asymmetric"):
        int4.quantize(_x(2, 32, seed=3), 32, symmetric=True, int8_zeros=True)


def test_kivi_keys_with_int8_zero_points_round_trip():
    k = _x(64, H, D, seed=4) * 2
    k[:, :, 1] += 40  # an outlier channel, per channel it is just an offset
    packed, scales, zeros = kivi.quantize_keys(k, 32, "fp8", int8_zeros=True)
    back = kivi.dequantize_keys(packed, scales, zeros, 32, "fp8")
    step = int4.load_meta(scales, "fp8").repeat_interleave(32, dim=0)
    assert bool(((back - k).abs() <= step / 2 * (1 + 1e-2) + 1e-6).all())
    assert float((back - k)[:, :, 1].abs().max()) < 0.5  # the offset channel keeps a fine grid


def test_int4_int8zeros_in_the_paged_cache_matches_the_codec():
    q, k, v = _x(10, HQ, D, seed=5), _x(10, H, D, seed=6), _x(10, H, D, seed=7)
    out, cache = _attend("int4_g8_asym_fp8scales_int8zeros", q, k, v)
    assert cache.k_zeros.dtype == torch.int8
    kd = int4.dequantize(*int4.quantize(k, 8, False, "fp8", True), 8, "fp8")
    vd = int4.dequantize(*int4.quantize(v, 8, False, "fp8", True), 8, "fp8")
    assert torch.allclose(out, attention_reference(q, kd, vd, SCALE), atol=1e-5)


# --- V rotated, the output rotated back ----------------------------------------------------------
@pytest.mark.parametrize("rotation", ["hadamard", "orthogonal"])
def test_rotating_k_q_and_v_leaves_attention_unchanged(rotation):
    q, k, v = _x(13, HQ, D, seed=8), _x(13, H, D, seed=9), _x(13, H, D, seed=10)
    ref, _ = _attend("fp32", q, k, v)
    out, cache = _attend(f"fp32_{rotation}_vrot", q, k, v)
    assert torch.allclose(out, ref, atol=1e-5)
    stored = cache.v[0].view(-1, H, D)[[3 * BLOCK + i for i in range(BLOCK)]]
    assert not torch.allclose(stored, v[:BLOCK], atol=1e-2)  # V really is stored rotated
    assert torch.allclose(stored, v[:BLOCK] @ cache.rotation, atol=1e-5)


def test_triton_rotates_the_output_back_too():
    q, k, v = _x(9, HQ, D, seed=11), _x(9, H, D, seed=12), _x(9, H, D, seed=13)
    ref, _ = _attend("fp32", q, k, v)
    out, _ = _attend("fp32_hadamard_vrot", q, k, v, backend="triton")
    assert torch.allclose(out, ref, atol=1e-5)
    quant_torch, _ = _attend("fp8_e4m3_hadamard_vrot", q, k, v)
    quant_triton, _ = _attend("fp8_e4m3_hadamard_vrot", q, k, v, backend="triton")
    assert torch.allclose(quant_triton, quant_torch, atol=1e-4)


def test_fp8_with_v_rotated_is_close_to_the_reference():
    q, k, v = _x(16, HQ, D, seed=14), _x(16, H, D, seed=15), _x(16, H, D, seed=16) * 0.05
    v[:, :, 4] += 3.0  # an outlier channel, spread over all 16 by the rotation
    ref = attention_reference(q, k, v, SCALE)
    out, _ = _attend("fp8_e4m3_hadamard_vrot", q, k, v)
    err = float((out - ref).norm() / ref.norm())
    assert 1e-4 < err < 0.03  # E4M3's relative step is 2^-3: a few percent at most, and not exact


# --- sinks ---------------------------------------------------------------------------------------
def _fp8(x):
    return fp8.decode(fp8.encode(x, "e4m3", "rne"))


def test_fp8_sink_keeps_the_first_tokens_in_16_bit_through_prefill_and_decode():
    T, start = 12, 5
    q, k, v = _x(T, HQ, D, seed=18), _x(T, H, D, seed=19), _x(T, H, D, seed=20)
    k[0] *= 40  # a sink-like first token: E4M3 rounds it coarsely
    k[0] = k[0].half().float()
    cache = PagedKVCache(1, 6, H, D, BLOCK, kv_cache_dtype="fp8_e4m3_sink2")
    table = [4, 1]
    attention_forward(cache, 0, q[:start], k[:start], v[:start], _meta([start], [start], [table]), SCALE)
    for n in range(start + 1, T + 1):
        out = attention_forward(cache, 0, q[n - 1:n], k[n - 1:n], v[n - 1:n], _meta([1], [n], [table]), SCALE)
    kd, vd = _fp8(k), _fp8(v)
    kd[:2], vd[:2] = k[:2], v[:2]
    assert torch.allclose(out, attention_reference(q, kd, vd, SCALE)[-1:], atol=1e-5)
    plain = attention_reference(q, _fp8(k), _fp8(v), SCALE)[-1:]
    assert float((out - plain).abs().max()) > 1e-3  # the sink did change the output


def test_kivi_sink_leaves_the_first_key_out_of_its_groups_range():
    T = 40
    q, k, v = _x(T, HQ, D, seed=21), _x(T, H, D, seed=22), _x(T, H, D, seed=23)
    k[0] = (k[0] * 50).half().float()  # the sink's key would stretch every channel's range 50 times
    ref = attention_reference(q, k, v, SCALE)
    err = {}
    for name in ("kivi_g8_fp8scales_int8zeros", "kivi_g8_fp8scales_int8zeros_sink1"):
        out, cache = _attend(name, q, k, v, table=(3, 0, 5, 1, 2))
        err[name] = float((out - ref).norm() / ref.norm())
    assert err["kivi_g8_fp8scales_int8zeros_sink1"] < 0.05
    assert err["kivi_g8_fp8scales_int8zeros_sink1"] < err["kivi_g8_fp8scales_int8zeros"] / 3


def test_a_reused_block_drops_its_stale_sink_and_copy_on_write_copies_it():
    cache = PagedKVCache(1, 6, H, D, BLOCK, kv_cache_dtype="fp8_e4m3_sink1", num_sinks=2)
    k, v, q = _x(12, H, D, seed=24), _x(12, H, D, seed=25), _x(12, HQ, D, seed=26)
    attention_forward(cache, 0, q[:3], k[:3], v[:3], _meta([3], [3], [[2]]), SCALE)
    assert int(cache.sinks.sink_of[2]) >= 0 and len(cache.sinks.free) == 1
    cache.copy_blocks([(2, 4)])
    assert int(cache.sinks.sink_of[4]) >= 0 and int(cache.sinks.sink_of[4]) != int(cache.sinks.sink_of[2])
    assert torch.equal(cache.sinks.k[0, cache.sinks.sink_of[4]], cache.sinks.k[0, cache.sinks.sink_of[2]])
    # block 2 freed, then reused as the second block of another sequence: its sink is stale
    attention_forward(cache, 0, q[:12], k[:12], v[:12], _meta([12], [12], [[0, 2]]), SCALE)
    assert int(cache.sinks.sink_of[2]) == -1 and int(cache.sinks.sink_of[0]) >= 0


def test_sinks_run_out_then_one_this_step_does_not_read_is_dropped():
    cache = PagedKVCache(1, 6, H, D, BLOCK, kv_cache_dtype="fp8_e4m3_sink1", num_sinks=1)
    k, v, q = _x(4, H, D, seed=27), _x(4, H, D, seed=28), _x(4, HQ, D, seed=29)
    attention_forward(cache, 0, q[:2], k[:2], v[:2], _meta([2], [2], [[1]]), SCALE)
    attention_forward(cache, 0, q[2:], k[2:], v[2:], _meta([2], [2], [[3]]), SCALE)
    assert int(cache.sinks.sink_of[1]) == -1 and int(cache.sinks.sink_of[3]) == 0
    with pytest.raises(RuntimeError, match="num_sinks"):
        # two new sequences, one sink
        attention_forward(cache, 0, q, k, v, _meta([2, 2], [2, 2], [[1], [5]]), SCALE)


@pytest.mark.parametrize("kwargs, words", [(dict(kv_cache_dtype="fp8_e4m3_sink9"), "block_size"),
                                           (dict(kv_cache_dtype="fp8_e4m3_sink1", num_sinks=0), "num_sinks")])
def test_bad_sink_caches_raise(kwargs, words):
    with pytest.raises(ValueError, match=words):
        PagedKVCache(1, 4, H, D, BLOCK, **kwargs)


def test_a_sink_cache_is_written_by_attend_only():
    cache = PagedKVCache(1, 4, H, D, BLOCK, kv_cache_dtype="fp8_e4m3_sink1")
    with pytest.raises(ValueError, match="written by attention_forward"):
        write_kv(cache, 0, _x(1, H, D, seed=30), _x(1, H, D, seed=31), torch.tensor([0]))
