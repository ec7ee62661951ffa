"""The checkers of notebook 06: each accepts a reference solution (written here from the formats'
definitions, not by calling the code it is checked against), rejects a stub that raises
NotImplementedError, and rejects plausible wrong answers with a plain counterexample. The Triton
ones (section 4) run under the interpreter here, small shapes."""
from __future__ import annotations

import functools
import math
import os

import pytest
import torch
import triton
import triton.language as tl

import radarlab.checks as checks

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
    verdict(checks.check_decode_e4m3, decode_e4m3)


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
    verdict(checks.check_decode_e4m3, fn, message)


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
    verdict(checks.check_encode_e4m3, encode_e4m3)


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
    verdict(checks.check_encode_e4m3, fn, message)


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
    verdict(checks.check_per_token_head_scale, per_token_head_scale)


@pytest.mark.parametrize("fn,message", [
    (_per_head, "it returned shape (1,), expected (1, 1) (one scale per token and head"),
    (_no_zero_guard, "token 1, head 0 was 0, expected 1 (an all-zero vector gets scale 1"),
    (_amax_only, "was 2, expected 0.00446429 (divide the amax by the largest E4M3 value, 448"),
    (_max_not_abs,
     "the scale of token 0, head 0 was 0.00223214, expected 0.00446429 (scale = "
     "max |x| over head_dim / 448)"),
])
def test_scale_mistakes_fail(verdict, fn, message):
    verdict(checks.check_per_token_head_scale, fn, message)


# --- section 4: the Triton puzzles and the FP8 load -------------------------------------------------
# Test kernels are module-level functions: Triton reads a kernel's source to run it. Each solution and
# its plausible mistakes are one function: MISTAKE, a compile-time constant, picks the mistake (0: none).
STUB = tl.constexpr(1)
CODE_AS_NUMBER = tl.constexpr(2)  # code.to(tl.float32): the byte's integer value, no table
CODE_AS_INT8 = tl.constexpr(3)  # the byte taken as signed: codes 0x80 and up index before the table
PACKED_ROWS = tl.constexpr(4)  # row n read at n * DIM, not n * stride_n


@triton.jit
def decode_tile_kernel(codes_ptr, table_ptr, out_ptr, stride_n, N: tl.constexpr, DIM: tl.constexpr,
                       MISTAKE: tl.constexpr = 0):
    n = tl.arange(0, N)[:, None]
    d = tl.arange(0, DIM)[None, :]
    if MISTAKE == STUB:
        raise NotImplementedError()
    row = stride_n
    if MISTAKE == PACKED_ROWS:
        row = DIM
    code = tl.load(codes_ptr + n * row + d)
    if MISTAKE == CODE_AS_NUMBER:
        x = code.to(tl.float32)
    elif MISTAKE == CODE_AS_INT8:
        x = tl.load(table_ptr + code.to(tl.int8))
    else:
        x = tl.load(table_ptr + code)
    tl.store(out_ptr + n * DIM + d, x)


class WithMistake:
    """A test kernel as the checker launches it (kernel[grid](...)), with MISTAKE set."""

    def __init__(self, kernel, mistake):
        self.kernel, self.mistake = kernel, mistake

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kernel[grid](*args, **kwargs, MISTAKE=self.mistake)


def test_decode_tile_solution_passes(verdict):
    verdict(checks.check_decode_tile, decode_tile_kernel)


@pytest.mark.parametrize("mistake,message", [
    (STUB, "the kernel is not written yet (it raises NotImplementedError)"),
    (CODE_AS_NUMBER, "out[0, 1] (code 0x01) is 1.0, expected 0.001953125: a code is an index into the decode "
                     "table, not a number"),
    (CODE_AS_INT8, "out[8, 0] (code 0x80) is -12345.0, expected -0.0: codes 0x80 and up were read from "
                   "before the table"),
    (PACKED_ROWS, "cut from a buffer 32 bytes wide (stride_n = 32), out[1, 0] (code 0x"),
])
def test_decode_tile_mistakes(verdict, mistake, message):
    out = verdict(checks.check_decode_tile, WithMistake(decode_tile_kernel, mistake), message)
    if mistake == PACKED_ROWS:
        assert "row n of the tile starts at codes_ptr + n * stride_n, not n * DIM" in out


DIVIDED = tl.constexpr(2)  # x / scale
NO_SCALE = tl.constexpr(3)
ONE_SCALE = tl.constexpr(4)  # TOKEN_SCALE ignored: every row takes scale_ptr[0]
COLUMN_SCALE = tl.constexpr(5)  # a scale from the wrong axis: scale_ptr + d


@triton.jit
def dequant_tile_kernel(codes_ptr, table_ptr, scale_ptr, out_ptr, N: tl.constexpr, DIM: tl.constexpr,
                        TOKEN_SCALE: tl.constexpr, MISTAKE: tl.constexpr = 0):
    n = tl.arange(0, N)[:, None]
    d = tl.arange(0, DIM)[None, :]
    if MISTAKE == STUB:
        raise NotImplementedError()
    x = tl.load(table_ptr + tl.load(codes_ptr + n * DIM + d))
    if TOKEN_SCALE and MISTAKE != ONE_SCALE:
        s = tl.load(scale_ptr + (d if MISTAKE == COLUMN_SCALE else n)).to(tl.float32)
    else:
        s = tl.load(scale_ptr)
    if MISTAKE == DIVIDED:
        x = x / s
    elif MISTAKE != NO_SCALE:
        x = x * s
    tl.store(out_ptr + n * DIM + d, x)


def test_dequant_tile_solution_passes(verdict):
    verdict(checks.check_dequant_tile, dequant_tile_kernel)


@pytest.mark.parametrize("mistake,message", [
    (STUB, "the kernel is not written yet (it raises NotImplementedError)"),
    (DIVIDED, "a static scale of 0.25 (one number for the tile), a 4 x 8 tile, out[0, 0] is"),
    (NO_SCALE, "the scale is missing: multiply the decoded tile by it"),
    (ONE_SCALE, "TOKEN_SCALE: row n has its own fp16 scale"),
    (COLUMN_SCALE, "the scales were spread along the columns (scale_ptr + d)"),
])
def test_dequant_tile_mistakes(verdict, mistake, message):
    out = verdict(checks.check_dequant_tile, WithMistake(dequant_tile_kernel, mistake), message)
    if mistake == DIVIDED:
        assert "it divided by the scale: the cache stores x / scale" in out
    if mistake == ONE_SCALE:
        assert "every row took scale 0: with TOKEN_SCALE, row n's scale is tl.load(scale_ptr + n)" in out


NO_MASK = tl.constexpr(4)  # rows that are not ok are loaded without a mask and kept
STATIC_ONLY = tl.constexpr(5)  # TOKEN_SCALE ignored: the static scale (1 here) for every token
HEAD0_STATIC = tl.constexpr(6)  # static_ptr[0] for every KV head
HEAD0_TOKEN_SCALE = tl.constexpr(7)  # the token scale's address without kv_head * stride_mh
STATIC_H_IGNORED = tl.constexpr(8)  # static_ptr + kv_head: past a per-tensor scale
HEAD0_CODES = tl.constexpr(9)  # the codes' address without kv_head * stride_ph
LOAD_DIVIDED = tl.constexpr(10)
LOAD_NO_SCALE = tl.constexpr(11)


@triton.jit
def fp8_load(ptr, scales_ptr, static_ptr, table_ptr, block, row, kv_head, d, ok,
             stride_pb, stride_ps, stride_ph, stride_pd, stride_mb, stride_ms, stride_mh, static_h,
             TOKEN_SCALE: tl.constexpr, MISTAKE: tl.constexpr = 0):
    if MISTAKE == STUB:
        raise NotImplementedError()
    mask = ok[:, None]
    head = kv_head * stride_ph
    if MISTAKE == HEAD0_CODES:
        head = 0
    offsets = (block * stride_pb + row * stride_ps + head)[:, None] + d[None, :] * stride_pd
    if MISTAKE == NO_MASK:
        code = tl.load(ptr + offsets)
    else:
        code = tl.load(ptr + offsets, mask=mask, other=0)
    if MISTAKE == CODE_AS_NUMBER:
        x = code.to(tl.float32)
    elif MISTAKE == CODE_AS_INT8:
        x = code.to(tl.int8).to(tl.float32)
    else:
        x = tl.load(table_ptr + code)
    if TOKEN_SCALE and MISTAKE != STATIC_ONLY:
        head = kv_head * stride_mh
        if MISTAKE == HEAD0_TOKEN_SCALE:
            head = 0
        s = tl.load(scales_ptr + block * stride_mb + row * stride_ms + head, mask=ok, other=1.0)
        s = s.to(tl.float32)[:, None]
    elif MISTAKE == HEAD0_STATIC:
        s = tl.load(static_ptr)
    elif MISTAKE == STATIC_H_IGNORED:
        s = tl.load(static_ptr + kv_head)
    else:
        s = tl.load(static_ptr + kv_head * static_h)
    if MISTAKE == LOAD_DIVIDED:
        x = x / s
    elif MISTAKE != LOAD_NO_SCALE:
        x = x * s
    if MISTAKE == NO_MASK:
        return x
    return tl.where(mask, x, 0.0)


def test_fp8_load_solution_passes(verdict):
    verdict(checks.check_fp8_load, fp8_load)


needs_interpreter = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason=(
    "the mistakes are bound with functools.partial, which only the interpreter calls as a jit function"))

FIRST_CASE = "for one sequence decoding at context 6 (blocks of 4, the second one partly filled)"


WRONG_KV_1 = "is wrong (wrong heads read KV heads [1]); "


@needs_interpreter
@pytest.mark.parametrize("mistake,message", [
    (STUB, "the function is not written yet (it raises NotImplementedError)"),
    (NO_MASK, f"{FIRST_CASE}, one scale per tensor (k_scale 0.5, v_scale 0.25: static_h = 0), 2 query heads "
              "over 2 KV heads, head_dim 16: new token 0, query head 0 is wrong (wrong heads read KV heads "
              "[0, 1]); NaN came out: a row that is not ok"),
    (CODE_AS_NUMBER, "a code is an index into the decode table, not a number"),
    (CODE_AS_INT8, "the codes were read as int8 numbers"),
    (LOAD_DIVIDED, "it divided by the scale: the cache stores x / scale, so the load multiplies"),
    (LOAD_NO_SCALE, "the scale is missing: multiply by the head's scale, static_ptr[kv_head * static_h]"),
    (STATIC_ONLY, "fp8_per_token_head: every token and KV head its own scale, contexts 7 and 12 with 1 and 4 "
                  "new tokens, 2 KV heads: new token 0, query head 0 is wrong (wrong heads read KV heads "
                  "[0, 1]); TOKEN_SCALE is on, and the token's own scale was not applied"),
    (HEAD0_STATIC, "for per-head scales (k_scale [0.25, 2], v_scale [0.5, 0.125]), GQA 4 query heads over 2 "
                   "KV heads, contexts 9 and 5 with 3 and 1 new tokens, scrambled block tables: new token 0, "
                   f"query head 2 {WRONG_KV_1}every KV head took head 0's scale"),
    (HEAD0_TOKEN_SCALE, f"{WRONG_KV_1}every KV head took KV head 0's token scale: add kv_head * stride_mh"),
    (STATIC_H_IGNORED, f"query head 1 {WRONG_KV_1}this scale is one number for all heads (static_h = 0): "
                       "read static_ptr + kv_head * static_h"),
    (HEAD0_CODES, f"query head 1 {WRONG_KV_1}every KV head read KV head 0's codes: add kv_head * stride_ph"),
])
def test_fp8_load_mistakes(verdict, mistake, message):
    verdict(checks.check_fp8_load, functools.partial(fp8_load, MISTAKE=mistake), message)
