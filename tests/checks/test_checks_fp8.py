"""The checkers of notebook 06: each accepts a reference solution (written here from the formats'
definitions, not by calling the code it is checked against), rejects a stub that raises
NotImplementedError, and rejects plausible wrong answers with a plain counterexample."""
from __future__ import annotations

import math

import pytest
import torch

from radarlab.checks import check_decode_e4m3, check_encode_e4m3, check_per_token_head_scale

# --- decode_e4m3 ---------------------------------------------------------------------------------

def decode_e4m3(code):
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = code >> 3 & 15, code & 7
    if exp == 15 and man == 7:
        return math.nan
    if exp == 0:
        return sign * man / 8 * 2.0**-6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def _ieee_like(code):  # exponent 15 as inf / NaN, as IEEE formats and E5M2 do
    if code >> 3 & 15 == 15:
        return (-math.inf if code & 0x80 else math.inf) if code & 7 == 0 else math.nan
    return decode_e4m3(code)


def _no_subnormals(code):
    exp, man = code >> 3 & 15, code & 7
    if exp == 0:
        return (-1.0 if code & 0x80 else 1.0) * (1 + man / 8) * 2.0**-7
    return decode_e4m3(code)


def _bias_8(code):
    v = decode_e4m3(code)
    return v / 2


def _unsigned(code):
    return abs(decode_e4m3(code)) if not math.isnan(decode_e4m3(code)) else math.nan


def test_decode_reference_passes(verdict):
    verdict(check_decode_e4m3, decode_e4m3)


@pytest.mark.parametrize("fn,message", [
    (_ieee_like,
     "code 0x7E (bits 0 1111 110) decoded to nan, expected 448.0 (E4M3fn, 'fn' for finite, has no "
                "infinity"),
    (_no_subnormals,
     "code 0x01 (bits 0 0000 001) decoded to 0.0087890625, expected 0.001953125 (exponent 0 is "
                     "subnormal"),
    (_bias_8, "code 0x38 (bits 0 0111 000) decoded to 0.5, expected 1.0 (the exponent bias of E4M3 is 7)"),
    (_unsigned, "code 0xB8 (bits 1 0111 000) decoded to 1.0, expected -1.0 (bit 7 is the sign)"),
    (lambda code: str(decode_e4m3(code)),
     "for code 0x38 (bits 0 0111 000) it returned '1.0'; expected a float"),
])
def test_decode_mistakes_fail(verdict, fn, message):
    verdict(check_decode_e4m3, fn, message)


# --- encode_e4m3 ---------------------------------------------------------------------------------

def _positive_values():
    # codes 0..0x7E, ascending
    return torch.tensor([decode_e4m3(c) for c in range(0x7F)], dtype=torch.float64)


def encode_e4m3(x, rounding):
    values = _positive_values()
    a = x.double().abs()
    nan = torch.isnan(a)
    a = torch.where(nan, 0.0, a).clamp(max=448.0)
    lo = (torch.searchsorted(values, a, right=True) - 1).clamp(0, 126)
    if rounding == "rne":
        hi = (lo + 1).clamp(max=126)
        d_lo, d_hi = a - values[lo], values[hi] - a
        lo = torch.where((d_hi < d_lo) | ((d_hi == d_lo) & (lo % 2 == 1)), hi, lo)
    codes = lo.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 7)
    return torch.where(nan, torch.tensor(0x7F, dtype=torch.uint8), codes)


def _always_rne(x, rounding):
    return encode_e4m3(x, "rne")


def _always_rtz(x, rounding):
    return encode_e4m3(x, "rtz")


def _nan_beyond_range(x, rounding):
    codes = encode_e4m3(x, rounding)
    return torch.where(x.abs() > 448, codes | 0x7F, codes)


def _rtz_floors_negatives(x, rounding):
    if rounding == "rne":
        return encode_e4m3(x, rounding)
    down = encode_e4m3(x, "rtz")
    values = _positive_values()
    exact = values[(down & 0x7F).long()] == x.double().abs()
    step = (x < 0) & ~exact & ((down & 0x7F) < 0x7E)
    return torch.where(step, down + 1, down)


def _ties_away(x, rounding):
    if rounding == "rtz":
        return encode_e4m3(x, rounding)
    return encode_e4m3(x.double() + torch.sign(x.double()) * x.double().abs() * 1e-9, "rne")


def _nan_to_zero(x, rounding):
    return encode_e4m3(torch.nan_to_num(x, nan=0.0, posinf=448.0, neginf=-448.0), rounding)


def _float_codes(x, rounding):
    return encode_e4m3(x, rounding).float()


def test_encode_reference_passes(verdict):
    verdict(check_encode_e4m3, encode_e4m3)


@pytest.mark.parametrize("fn,message", [
    (_always_rtz,
     "values between codes, rounding='rne', x=1.100000023841858 gave code 0x38 (1.0), expected 0x39 "
                  "(1.125) (that is rounding toward zero, what vLLM's CPU kernels do"),
    (_always_rne,
     "values between codes, rounding='rtz', x=1.100000023841858 gave code 0x39 (1.125), expected 0x38 "
                  "(1.0) (that is rounding to nearest"),
    (_nan_beyond_range, "x=449.0 gave code 0x7F (nan), expected 0x7E (448.0) (beyond 448 saturate"),
    (_rtz_floors_negatives,
     "x=-1.100000023841858 gave code 0xB9 (-1.125), expected 0xB8 (-1.0) (toward zero for "
                            "negatives too"),
    (_ties_away, "x=1.0625 gave code 0x39 (1.125), expected 0x38 (1.0) (a tie goes to the even code"),
    (_nan_to_zero, "x=nan gave code 0x00 (0.0), expected 0x7F (nan) (a NaN stays NaN"),
    (_float_codes, "expected uint8 codes of shape (6,)"),
])
def test_encode_mistakes_fail(verdict, fn, message):
    verdict(check_encode_e4m3, fn, message)


# --- per_token_head_scale ------------------------------------------------------------------------

def per_token_head_scale(x):
    s = x.abs().amax(dim=-1) / 448.0
    return torch.where(s > 0, s, torch.ones_like(s))


def _per_head(x):
    s = x.abs().amax(dim=(0, 2)) / 448.0
    return torch.where(s > 0, s, torch.ones_like(s))


def _no_zero_guard(x):
    return x.abs().amax(dim=-1) / 448.0


def _amax_only(x):
    s = x.abs().amax(dim=-1)
    return torch.where(s > 0, s, torch.ones_like(s))


def _max_not_abs(x):
    s = x.amax(dim=-1) / 448.0
    return torch.where(s > 0, s, torch.ones_like(s))


def test_scale_reference_passes(verdict):
    verdict(check_per_token_head_scale, per_token_head_scale)


@pytest.mark.parametrize("fn,message", [
    (_per_head, "it returned shape (1,), expected (1, 1) (one scale per token and head"),
    (_no_zero_guard, "token 1, head 0 was 0, expected 1 (an all-zero vector gets scale 1"),
    (_amax_only, "was 2, expected 0.00446429 (divide the amax by the largest E4M3 value, 448"),
    (_max_not_abs,
     "the scale of token 0, head 0 was 0.00223214, expected 0.00446429 (scale = "
     "max |x| over head_dim / 448)"),
])
def test_scale_mistakes_fail(verdict, fn, message):
    verdict(check_per_token_head_scale, fn, message)
