"""The checkers of notebook 07: a reference passes, a stub and plausible mistakes get a plain
counterexample."""
from __future__ import annotations

import pytest
import torch

from radarlab.checks import (
    check_int4_bytes_per_token,
    check_kivi_key_dequant,
    check_kivi_keys,
    check_kivi_value_dequant,
    check_kivi_values,
    check_pack_nibbles,
    check_quantize_group,
    check_quantized_length,
)
from radarlab.checks.nb07_int4 import reference_int4_bytes_per_token, reference_quantize_group
from radarlab.quant import int4, kivi
from radarlab.util import cdiv

# --- pack_nibbles --------------------------------------------------------------------------------

def pack_reference(codes):
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _high_first(codes):  # element 2i in the high nibble
    return (codes[..., 0::2] << 4) | codes[..., 1::2]


def _added(codes):  # adds the two codes instead of shifting one
    return codes[..., 0::2] + codes[..., 1::2]


def _int64(codes):
    return pack_reference(codes).long()


def _flattens(codes):  # packs the whole tensor as one row
    return pack_reference(codes.reshape(-1))


def test_pack_reference_passes(verdict):
    verdict(check_pack_nibbles, pack_reference)


@pytest.mark.parametrize("fn, words", [
    (_high_first, "low nibble"),
    (_added, "expected 33"),
    (_int64, "dtype torch.int64"),
    (_flattens, "shape (768,)"),
])
def test_pack_mistakes_are_described(verdict, fn, words):
    verdict(check_pack_nibbles, fn, words)


# --- quantize_group ------------------------------------------------------------------------------

def quantize_group_float32(x, group_size):
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return codes.reshape(x.shape), scale, lo


def _sixteen_steps(x, group_size):  # 16 levels taken as 16 steps: the maximum clamps a whole step away
    codes, scale, lo = quantize_group_float32(x, group_size)
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    s = scale * 15 / 16
    codes = torch.round((g - lo[..., None]) / s[..., None]).clamp(0, 15).to(torch.uint8)
    return codes.reshape(x.shape), s, lo


def _symmetric(x, group_size):  # the symmetric rule where the asymmetric one is asked for
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    scale = (g.abs().amax(-1) / 7).clamp(min=1e-8)
    codes = (torch.round(g / scale[..., None]).clamp(-8, 7) + 8).to(torch.uint8)
    return codes.reshape(x.shape), scale, -8 * scale


def _truncates(x, group_size):  # floor instead of round: up to a whole step off
    codes, scale, lo = quantize_group_float32(x, group_size)
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    codes = torch.floor((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return codes.reshape(x.shape), scale, lo


def _one_scale_per_row(x, group_size):  # ignores the group size
    return quantize_group_float32(x, x.shape[-1])


def _divides_by_zero(x, group_size):  # a constant group gives scale 0 and NaN codes
    g = x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = (hi - lo) / 15
    codes = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15)
    return codes.to(torch.uint8).reshape(x.shape), scale, lo + torch.where(hi > lo, 0.0, float("nan"))


@pytest.mark.parametrize("fn", [reference_quantize_group, quantize_group_float32])
def test_quantize_group_references_pass(verdict, fn):
    verdict(check_quantize_group, fn)


@pytest.mark.parametrize("fn, words", [
    (_sixteen_steps, "15 steps"),
    (_symmetric, "zero point"),
    (_truncates, "more than half a step"),
    (_one_scale_per_row, "one per group"),
    (_divides_by_zero, "not finite"),
])
def test_quantize_group_mistakes_are_described(verdict, fn, words):
    verdict(check_quantize_group, fn, words)


def test_reference_quantize_group_round_trips_within_half_a_step():
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    codes, scales, zeros = reference_quantize_group(x, 32)
    back = (codes.float().reshape(3, 2, 32) * scales[..., None] + zeros[..., None]).reshape(3, 64)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    assert bool(((back - x).abs() <= scales.repeat_interleave(32, -1) / 2 + 1e-6).all())


# --- int4_bytes_per_token ------------------------------------------------------------------------

def bytes_reference(layers, kv_heads, head_dim, group_size, symmetric, scale_bytes):
    values = 2 * layers * kv_heads * head_dim
    return values // 2 + values // group_size * scale_bytes * (1 if symmetric else 2)


def _codes_only(layers, kv_heads, head_dim, group_size, symmetric, scale_bytes):
    return 2 * layers * kv_heads * head_dim // 2


def _keys_only(layers, kv_heads, head_dim, group_size, symmetric, scale_bytes):
    return bytes_reference(layers, kv_heads, head_dim, group_size, symmetric, scale_bytes) // 2


def _no_zero_points(layers, kv_heads, head_dim, group_size, symmetric, scale_bytes):
    return bytes_reference(layers, kv_heads, head_dim, group_size, True, scale_bytes)


def _fp16_always(layers, kv_heads, head_dim, group_size, symmetric, scale_bytes):
    return bytes_reference(layers, kv_heads, head_dim, group_size, symmetric, 2)


@pytest.mark.parametrize("fn", [bytes_reference, reference_int4_bytes_per_token])
def test_bytes_references_pass(verdict, fn):
    verdict(check_int4_bytes_per_token, fn)


def test_reference_bytes_counts_the_article_row_and_rejects_odd_scale_sizes():
    # 80 x 8 x 128 x 2 values a token: 81,920 bytes of codes, plus 1,280 groups x (2 + 2) bytes
    assert reference_int4_bytes_per_token(80, 8, 128, 128, False, 2) == 81920 + 1280 * 4
    with pytest.raises(ValueError, match="scale_bytes"):
        reference_int4_bytes_per_token(80, 8, 128, 128, False, 4)


@pytest.mark.parametrize("fn, words", [
    (_codes_only, "the 4-bit codes alone"),
    (_keys_only, "both K and V"),
    (_no_zero_points, "zero point beside its scale"),
    (_fp16_always, "fp8 scales"),
])
def test_bytes_mistakes_are_described(verdict, fn, words):
    verdict(check_int4_bytes_per_token, fn, words)


# --- quantize_group: groups along the wrong axis ---------------------------------------------------

def _strided_groups(x, group_size):  # group j takes every (n / g)-th value, not g consecutive ones
    n = x.shape[-1]
    strided = x.reshape(*x.shape[:-1], group_size, n // group_size).transpose(-1, -2).reshape(x.shape)
    codes, scales, zeros = quantize_group_float32(strided, group_size)
    codes = codes.reshape(*x.shape[:-1], n // group_size, group_size).transpose(-1, -2).reshape(x.shape)
    return codes, scales, zeros


def test_quantize_group_strided_groups_are_described(verdict):
    verdict(check_quantize_group, _strided_groups, "for x = [-1, 1, 2, 5], groups of 2, group 1's zero point "
                                                   "is 1, expected its minimum 2")


# --- the main exercise: quantize_keys_per_channel and quantized_length ---------------------------

def kivi_keys_reference(k, group_size):  # the notebook's answer
    t, h, d = k.shape
    groups = k.float().reshape(t // group_size, group_size, h, d)  # a group's g tokens on axis 1
    zeros = groups.amin(1).half()
    scales = ((groups.amax(1) - zeros.float()) / 15).clamp(min=2.0**-24).half()
    codes = torch.round((groups - zeros.float()[:, None]) / scales.float()[:, None]).clamp(0, 15)
    return codes.to(torch.uint8).reshape(t, h, d), scales, zeros


def _per_token(k, group_size):  # groups of g channels of one token, along head_dim: the per-token layout
    codes, scales, zeros = int4.quantize_codes(k, group_size, symmetric=False)
    return codes, scales, zeros


def _reshape_not_permute(k, group_size):  # [T/g, H, D, g] by reshape: a "group" is g channels of a token
    t, h, d = k.shape
    groups = k.reshape(t // group_size, h, d, group_size)
    zeros = groups.amin(-1).half()
    scales = ((groups.amax(-1) - zeros.float()) / 15).clamp(min=2.0**-24).half()
    codes = torch.round((groups - zeros.float()[..., None]) / scales.float()[..., None]).clamp(0, 15)
    return codes.to(torch.uint8).reshape(t, h, d), scales, zeros


def _symmetric(k, group_size):  # the symmetric grid: no zero point, codes centred on 8
    t, h, d = k.shape
    groups = k.reshape(t // group_size, group_size, h, d)
    scales = (groups.abs().amax(1) / 7).clamp(min=2.0**-24).half()
    codes = (torch.round(groups / scales.float()[:, None]).clamp(-8, 7) + 8).to(torch.uint8)
    return codes.reshape(t, h, d), scales, torch.zeros_like(scales)


def _fp32_scales(k, group_size):  # exact float32 scales and zeros: not what the cache stores
    codes, scales, zeros = kivi_keys_reference(k, group_size)
    return codes, scales.float(), zeros.float()


def _packed(k, group_size):  # packs the codes: the cache packs them itself
    return kivi.quantize_keys(k, group_size)


@pytest.mark.parametrize("fn", [kivi_keys_reference, kivi.quantize_key_codes])
def test_kivi_keys_references_pass(verdict, fn):
    verdict(check_kivi_keys, fn)


def test_the_notebook_answer_is_radarlab_quantizer_bit_for_bit():
    k = torch.randn(64, 3, 64, generator=torch.Generator().manual_seed(1)) * 3
    for mine, theirs in zip(kivi_keys_reference(k, 32), kivi.quantize_key_codes(k, 32)):
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs)


@pytest.mark.parametrize("fn, words", [
    (_per_token, "one per token and group of g channels, along head_dim"),
    (_reshape_not_permute, "reduce over the g tokens of a group"),
    (_symmetric, "asymmetric: the zero point is the group's minimum"),
    (_fp32_scales, "scales have dtype torch.float32; the cache stores them in torch.float16"),
    (_packed, "codes has shape (4, 1, 2), expected (4, 1, 4) (one code per key value, unpacked)"),
])
def test_kivi_keys_mistakes_are_described(verdict, fn, words):
    verdict(check_kivi_keys, fn, words)


def kivi_values_reference(v, group_size):  # the notebook's answer
    t, h, d = v.shape
    groups = v.float().reshape(t, h, d // group_size, group_size)  # g channels of one token on the last axis
    zeros = groups.amin(-1).half()
    scales = ((groups.amax(-1) - zeros.float()) / 15).clamp(min=2.0**-24).half()
    codes = torch.round((groups - zeros.float()[..., None]) / scales.float()[..., None]).clamp(0, 15)
    return codes.to(torch.uint8).reshape(t, h, d), scales, zeros


def _values_per_channel(v, group_size):  # the keys' layout
    return kivi.quantize_key_codes(v, group_size)


def _values_sixteen_levels(v, group_size):
    t, h, d = v.shape
    groups = v.float().reshape(t, h, d // group_size, group_size)
    zeros = groups.amin(-1).half()
    scales = ((groups.amax(-1) - zeros.float()) / 16).clamp(min=2.0**-24).half()
    codes = torch.round((groups - zeros.float()[..., None]) / scales.float()[..., None]).clamp(0, 15)
    return codes.to(torch.uint8).reshape(t, h, d), scales, zeros


def _values_exact_codes(v, group_size):  # codes from the float32 zero and scale, stored ones rounded after
    t, h, d = v.shape
    groups = v.float().reshape(t, h, d // group_size, group_size)
    lo, scale = groups.amin(-1), ((groups.amax(-1) - groups.amin(-1)) / 15).clamp(min=2.0**-24)
    codes = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15)
    return codes.to(torch.uint8).reshape(t, h, d), scale.float(), lo.float()


@pytest.mark.parametrize("fn", [kivi_values_reference,
                                kivi.quantize_value_codes])
def test_kivi_values_references_pass(verdict, fn):
    verdict(check_kivi_values, fn)


def test_the_values_answer_is_radarlab_quantizer_bit_for_bit():
    v = torch.randn(64, 3, 64, generator=torch.Generator().manual_seed(2)) * 3
    for mine, theirs in zip(kivi_values_reference(v, 32), int4.quantize_codes(v, 32, symmetric=False)):
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs)


@pytest.mark.parametrize("fn, words", [
    (_values_per_channel, "that is the keys' layout, one per channel over g tokens"),
    (_values_sixteen_levels, "16 levels have 15 steps between them"),
    (_values_exact_codes, "scales have dtype torch.float32; the cache stores them in torch.float16"),
])
def test_kivi_values_mistakes_are_described(verdict, fn, words):
    verdict(check_kivi_values, fn, words)


def kivi_key_dequant_reference(codes, scales, zeros, group_size):  # the notebook's answer
    t, h, d = codes.shape
    groups = codes.float().reshape(t // group_size, group_size, h, d)
    return (groups * scales.float()[:, None] + zeros.float()[:, None]).reshape(t, h, d)


def kivi_value_dequant_reference(codes, scales, zeros, group_size):  # the notebook's answer
    t, h, d = codes.shape
    groups = codes.float().reshape(t, h, d // group_size, group_size)
    return (groups * scales.float()[..., None] + zeros.float()[..., None]).reshape(t, h, d)


def _dequant_with(mistake, keys):
    def dequant(codes, scales, zeros, group_size):
        axis = 0 if keys else -1
        s, z = (m.float().repeat_interleave(group_size, dim=axis) for m in (scales, zeros))
        if mistake == "tiled":
            times = (group_size, 1, 1) if keys else (1, 1, group_size)
            s, z = (m.float().repeat(*times) for m in (scales, zeros))
        c = codes.float()
        return {"subtract zero": (c - z) * s, "no zero": c * s, "minus 8": (c - 8) * s, "swapped": c * z + s,
                "half": (c * s + z).half()}.get(mistake, c * s + z)
    return dequant


@pytest.mark.parametrize("check, fn", [(check_kivi_key_dequant, kivi_key_dequant_reference),
                                       (check_kivi_key_dequant, kivi.dequantize_key_codes),
                                       (check_kivi_key_dequant, _dequant_with(None, keys=True)),
                                       (check_kivi_value_dequant, kivi_value_dequant_reference),
                                       (check_kivi_value_dequant, int4.dequantize_codes),
                                       (check_kivi_value_dequant, _dequant_with(None, keys=False))])
def test_kivi_dequant_references_pass(verdict, check, fn):
    verdict(check, fn)


@pytest.mark.parametrize("keys", [True, False])
@pytest.mark.parametrize("mistake, words", [
    ("subtract zero", "it computed (code - zero) x scale"),
    ("no zero", "the zero point was left out"),
    ("minus 8", "the symmetric grid's centre"),
    ("tiled", "tiled along"),
    ("swapped", "the scales and zeros were swapped"),
    ("half", "return float32 values"),
])
def test_kivi_dequant_mistakes_are_described(verdict, keys, mistake, words):
    check = check_kivi_key_dequant if keys else check_kivi_value_dequant
    out = verdict(check, _dequant_with(mistake, keys), words)
    assert mistake != "tiled" or ("tokens" if keys else "channels") in out


def test_the_kivi_codec_stubs_are_not_written(verdict):
    def stub(*args):
        raise NotImplementedError()

    for check in (check_kivi_values, check_kivi_key_dequant, check_kivi_value_dequant):
        verdict(check, stub, "not written yet")


def quantized_length_reference(num_tokens, group_size, residual):  # the notebook's answer
    return max(0, num_tokens - residual) // group_size * group_size


def _no_window(num_tokens, group_size, residual):
    return num_tokens // group_size * group_size


def _rounds_up(num_tokens, group_size, residual):
    return max(0, cdiv(num_tokens - residual, group_size) * group_size)


def _negative(num_tokens, group_size, residual):  # no floor at 0: -108 // 32 is -4
    return (num_tokens - residual) // group_size * group_size


def _one_short(num_tokens, group_size, residual):  # off by one: a complete group waits one token more
    return max(0, num_tokens - residual - 1) // group_size * group_size


def _float(num_tokens, group_size, residual):
    return max(0, num_tokens - residual) // group_size * float(group_size)


@pytest.mark.parametrize("fn", [quantized_length_reference, kivi.quantized_length])
def test_quantized_length_references_pass(verdict, fn):
    verdict(check_quantized_length, fn)


@pytest.mark.parametrize("fn, words", [
    (_no_window, "num_tokens=159, group_size=32, residual=128 it returned 128, expected 0 (leave the newest"),
    (_rounds_up, "num_tokens=31, group_size=32, residual=0 it returned 32, expected 0 (only whole groups"),
    (_negative, "returned -128, expected 0 (fewer tokens than the window"),
    (_one_short, "num_tokens=32, group_size=32, residual=0 it returned 0, expected 32 (off by one group"),
    (_float, "returned 0.0 (float); expected the int 0"),
])
def test_quantized_length_mistakes_are_described(verdict, fn, words):
    verdict(check_quantized_length, fn, words)
