"""INT4 group-wise, KIVI and rotations: packing, round trips within a step, bad inputs."""
from __future__ import annotations

import pytest
import torch

from radarlab.quant import int4, kivi
from radarlab.quant.rotation import hadamard_matrix, random_orthogonal, rotate, rotation_matrix


def _x(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_pack_unpack_round_trip_and_nibble_order():
    q = torch.randint(0, 16, (3, 4, 10), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    packed = int4.pack(q)
    assert packed.shape == (3, 4, 5) and torch.equal(int4.unpack(packed), q)
    assert int4.pack(torch.tensor([1, 2], dtype=torch.uint8)).item() == 0x21  # element 0 in the low nibble
    with pytest.raises(ValueError, match="4-bit codes"):
        int4.pack(torch.tensor([16, 0], dtype=torch.uint8))
    with pytest.raises(ValueError, match="even last axis"):
        int4.pack(torch.zeros(3, dtype=torch.uint8))


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("scale_dtype", ["fp16", "fp8"])
@pytest.mark.parametrize("g", [16, 32, 64])
def test_round_trip_error_is_at_most_half_a_step(symmetric, scale_dtype, g):
    x = _x(7, 3, 64) * 2
    packed, scales, zeros = int4.quantize(x, g, symmetric, scale_dtype)
    assert packed.shape == (7, 3, 32) and scales.shape == (7, 3, 64 // g)
    assert (zeros is None) == symmetric
    assert scales.dtype == (torch.float16 if scale_dtype == "fp16" else torch.uint8)
    back = int4.dequantize(packed, scales, zeros, g, scale_dtype)
    step = int4.load_meta(scales, scale_dtype).repeat_interleave(g, dim=-1)
    assert bool(((back - x).abs() <= step / 2 * 1.001 + 1e-6).all())
    # a step is the group's range over 15 (asym) or its amax over 7 (sym), within the scale's rounding
    amax = x.reshape(7, 3, 64 // g, g).abs().amax(-1)
    if symmetric:
        ratio = int4.load_meta(scales, scale_dtype) / (amax / 7)
        # fp8 rounds the scale up by at most one step, 1/8 and bool((ratio <= (1.125 if scale_dtype == "fp8"
        # else 1.001)).all())
        assert bool((ratio >= 0.999).all())


def test_asymmetric_beats_symmetric_on_a_lopsided_group():
    x = torch.rand(4, 1, 64) + 5.0  # all positive: symmetric wastes half its codes
    sym = int4.dequantize(*int4.quantize(x, 64, True), 64)
    asym = int4.dequantize(*int4.quantize(x, 64, False), 64)
    assert float((asym - x).abs().max()) * 5 < float((sym - x).abs().max())


def test_zero_groups_and_asymmetric_constant_groups_decode_exactly():
    x = torch.zeros(2, 1, 32)
    x[1] = 0.5
    assert torch.equal(int4.dequantize(*int4.quantize(x, 32, False), 32), x)  # the zero point is the value
    sym = int4.dequantize(*int4.quantize(x, 32, True), 32)
    assert torch.equal(sym[0], x[0]) and torch.allclose(sym[1], x[1], rtol=1e-3)  # 7 x the fp16 scale


def test_nan_in_a_group_stays_visible():
    x = _x(2, 1, 32)
    x[1, 0, 5] = float("nan")
    back = int4.dequantize(*int4.quantize(x, 16, False), 16)
    assert bool(back[1, 0, 5].isnan()) and not bool(back[0].isnan().any())


@pytest.mark.parametrize("scale_dtype", ["fp16", "fp8"])
def test_values_beyond_the_scale_range_saturate_and_never_become_inf(scale_dtype):
    x = _x(2, 32)
    x[0, 3] = 1e9  # amax / 7 is beyond fp16 (and E4M3): the scale saturates, the value is clipped
    x[1, 5] = -1e9
    for sym in (True, False):
        back = int4.dequantize(*int4.quantize(x, 16, sym, scale_dtype), 16, scale_dtype)
        assert bool(torch.isfinite(back).all())
        assert float(back[0, 3]) > 0 and float(back[1, 5]) < 0


def test_bad_groups_and_shapes_raise():
    with pytest.raises(ValueError, match=r"group_size \(48\) must divide the grouped axis \(64\)"):
        int4.quantize(_x(2, 64), 48)
    with pytest.raises(ValueError, match="group_size must be a positive int"):
        int4.quantize(_x(2, 64), 0)
    with pytest.raises(ValueError, match="scale_dtype must be one of fp16, fp8"):
        int4.quantize(_x(2, 64), 32, scale_dtype="bf16")
    packed, scales, zeros = int4.quantize(_x(2, 64), 32)
    with pytest.raises(ValueError, match=r"scales must have shape \(2, 2\)"):
        int4.dequantize(packed, scales[:, :1], zeros, 32)


def test_fp8_scales_round_up_and_zeros_down():
    x = torch.tensor([0.3, -1.7, 0.01, 100.0, -0.0001, 0.0])
    up = int4.load_meta(int4.store_meta(x.abs(), "fp8", "up"), "fp8")
    assert bool((up >= x.abs()).all())
    down = int4.load_meta(int4.store_meta(x, "fp8", "down"), "fp8")
    assert bool((down <= x).all())


# ----------------------------------------------------------------------------- KIVI

def test_kivi_keys_per_channel_handle_an_outlier_channel():
    k = _x(64, 2, 64)
    k[:, :, 7] += 40.0  # one outlier channel, as real keys have
    per_token = int4.dequantize(*int4.quantize(k, 64, False), 64)
    per_channel = kivi.dequantize_keys(*kivi.quantize_keys(k, 32), 32)
    normal = [c for c in range(64) if c != 7]
    err_token = (per_token - k)[:, :, normal].abs().mean()
    err_channel = (per_channel - k)[:, :, normal].abs().mean()
    assert float(err_channel) * 5 < float(err_token)


@pytest.mark.parametrize("tokens, residual, quantized", [(100, 0, 96), (100, 40, 32), (31, 0, 0), (64, 0, 64),
                                                          (200, 128, 64)])
def test_kivi_quantized_length_and_tail(tokens, residual, quantized):
    assert kivi.quantized_length(tokens, 32, residual) == quantized
    k, v = _x(tokens, 2, 64, seed=1), _x(tokens, 2, 64, seed=2)
    kv = kivi.quantize(k, v, 32, residual)
    assert kv.num_quantized == quantized and kv.k_tail.shape[0] == tokens - quantized
    kb, vb = kivi.dequantize(kv)
    assert kb.shape == k.shape
    assert torch.equal(kb[quantized:], k[quantized:].half().float())  # the tail is only rounded to 16-bit
    if quantized:
        assert 0 < float((kb[:quantized] - k[:quantized]).abs().max()) < 0.5


def test_kivi_bad_group():
    with pytest.raises(ValueError, match="must divide"):
        kivi.quantize(_x(64, 2, 64), _x(64, 2, 64), group_size=48)


# ----------------------------------------------------------------------------- rotations

@pytest.mark.parametrize("kind", ["hadamard", "orthogonal"])
def test_rotation_is_orthogonal_and_keeps_dot_products(kind):
    r = rotation_matrix(kind, 64)
    assert torch.allclose(r @ r.T, torch.eye(64), atol=1e-5)
    q, k = _x(5, 64, seed=3), _x(9, 64, seed=4)
    assert torch.allclose(rotate(q, r) @ rotate(k, r).T, q @ k.T, atol=1e-4)


def test_hadamard_spreads_an_outlier_channel():
    k = torch.zeros(64)
    k[3] = 8.0
    rotated = rotate(k, hadamard_matrix(64))
    assert torch.allclose(rotated.abs(), torch.full((64,), 1.0))  # 8 / sqrt(64) in every channel


def test_rotation_bad_inputs():
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(48)
    with pytest.raises(ValueError, match="rotation must be one of hadamard, orthogonal"):
        rotation_matrix("givens", 8)
    with pytest.raises(ValueError, match=r"rotation must be \[8, 8\]"):
        rotate(_x(2, 8), random_orthogonal(4))
    assert torch.equal(random_orthogonal(8, seed=1), random_orthogonal(8, seed=1))


@pytest.mark.parametrize("tokens, keys, values",
                         [(100, 0, 0), (128, 128, 0), (200, 128, 72), (300, 256, 172)])
def test_kivi_rule_keeps_t_mod_r_keys_and_a_window_of_r_values(tokens, keys, values):
    """KIVI's code: keys quantized R at a time (T mod R left in 16-bit), values all but the newest R;
    radarlab's rule leaves at least R of both, whole groups."""
    assert kivi.quantized_lengths(tokens, 32, 128, rule="kivi") == (keys, values)
    n = kivi.quantized_length(tokens, 32, 128)
    assert kivi.quantized_lengths(tokens, 32, 128) == (n, n) and tokens - n >= min(tokens, 128)
    k, v = _x(tokens, 2, 64, seed=3), _x(tokens, 2, 64, seed=4)
    kv = kivi.quantize(k, v, 32, 128, rule="kivi")
    assert (kv.num_quantized, kv.values[0].shape[0]) == (keys, values)
    assert (kv.k_tail.shape[0], kv.v_tail.shape[0]) == (tokens - keys, tokens - values)
    kb, vb = kivi.dequantize(kv)
    assert torch.equal(vb[values:], v[values:].half().float())  # the tails are only rounded to 16-bit
    assert torch.equal(kb[keys:], k[keys:].half().float())
    if values:
        assert 0 < float((vb[:values] - v[:values]).abs().max()) < 0.5


def test_kivi_rule_needs_a_window_of_whole_groups():
    with pytest.raises(ValueError, match="positive multiple of group_size"):
        kivi.quantized_lengths(100, 32, 48, rule="kivi")
    with pytest.raises(ValueError, match="rule must be one of"):
        kivi.quantized_lengths(100, 32, 64, rule="KIVI")


def test_key_codes_are_the_packed_keys_unpacked():
    k = _x(64, 2, 64, seed=5)
    codes, scales, zeros = kivi.quantize_key_codes(k, 32)
    packed, s2, z2 = kivi.quantize_keys(k, 32)
    assert codes.shape == k.shape and torch.equal(int4.pack(codes), packed)
    assert torch.equal(scales, s2) and torch.equal(zeros, z2) and scales.dtype == torch.float16
