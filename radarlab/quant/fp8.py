"""FP8 from bits: the 256 codes of E4M3 (fn) and E5M2, encoding with a chosen rounding, and scales.

A code is sign | exponent | mantissa. E4M3fn: 4 exponent bits (bias 7), 3 mantissa bits, no
infinities, NaN only at S.1111.111, largest finite 448. E5M2: 5 exponent bits (bias 15), 2 mantissa
bits, IEEE-like (exponent 31 is inf or NaN), largest finite 57344. Exponent 0 is subnormal:
mantissa / 2^m x 2^(1 - bias).

The cache stores x / scale as a code (uint8) and reads code -> value x scale. Encoding here:
- rounding "rne" (round to nearest, ties to the even code): what torch's .to(float8_*) and CUDA's
  conversion instructions do;
- rounding "rtz" (round toward zero: drop the mantissa bits that do not fit): what vLLM's CPU
  kernels do when they convert to FP8, so CPU caches sit up to one step closer to zero than CUDA's.
  vLLM 0.32's CPU wheel ships its kernels compiled only, so this was checked on the op itself:
  cpu_attn_reshape_and_cache with kv_cache_dtype fp8_e4m3 / fp8_e5m2 (scale 1, the "vec" kernel,
  fp32 and bf16 inputs, 2,048 values up to |x| = 1,640) stores exactly the codes encode(x, rtz)
  gives (compared as multisets: its block layout is internal); round-to-nearest-even differs in
  35-47% of them. Beyond the range it saturates too (448 for E4M3), never inf or NaN;
- beyond the largest finite value (inf included) saturates to it, with its sign: never inf;
- NaN stays NaN (a NaN code), so a broken activation stays detectable.

Scales, the four rules the course compares:
- 1.0, what vLLM 0.32 uses when a checkpoint carries no KV scales;
- calibrated offline, per tensor or per head: amax / largest finite (llm-compressor's form, which
  vLLM loads as k_scale / v_scale);
- the rule of older vLLM releases (calculate_kv_scales, removed since): amax / 200 for K and
  amax / 100 for V, from the first batch;
- dynamic, per token and head: amax of that head's vector / largest finite, stored beside the codes.
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch

from radarlab.quant.formats import FP8_FORMATS, ROUNDINGS

# name -> (exponent bits, mantissa bits, bias, has infinities)
_LAYOUT = {"e4m3": (4, 3, 7, False), "e5m2": (5, 2, 15, True)}
TORCH_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
SCALE_RULES = ("tensor", "head", "token_head")
LEGACY_K_DIVISOR = 200.0  # vLLM's old calculate_kv_scales: k_scale = amax(k) / 200
LEGACY_V_DIVISOR = 100.0  # and v_scale = amax(v) / 100


def _check_format(fmt: str) -> str:
    if fmt not in _LAYOUT:
        raise ValueError(f"fp8 format must be one of {', '.join(FP8_FORMATS)}, got {fmt!r}")
    return fmt


def decode_code(code: int, fmt: str = "e4m3") -> float:
    """The value of one 8-bit code, from its bits."""
    exp_bits, man_bits, bias, has_inf = _LAYOUT[_check_format(fmt)]
    sign = -1.0 if code >> 7 & 1 else 1.0
    exp = code >> man_bits & ((1 << exp_bits) - 1)
    man = code & ((1 << man_bits) - 1)
    top = (1 << exp_bits) - 1
    if has_inf and exp == top:
        return sign * math.inf if man == 0 else math.nan
    if not has_inf and exp == top and man == (1 << man_bits) - 1:
        return math.nan
    if exp == 0:
        return sign * man / (1 << man_bits) * 2.0 ** (1 - bias)
    return sign * (1 + man / (1 << man_bits)) * 2.0 ** (exp - bias)


@lru_cache(maxsize=None)
def _table(fmt: str) -> torch.Tensor:
    return torch.tensor([decode_code(c, fmt) for c in range(256)], dtype=torch.float32)


def decode_table(fmt: str = "e4m3") -> torch.Tensor:
    """float32 [256]: the value of every code (a copy: callers may move it to a device)."""
    return _table(_check_format(fmt)).clone()


@lru_cache(maxsize=None)
def _positive(fmt: str) -> torch.Tensor:
    """The finite non-negative values, indexed by code (codes 0..max: bit order is value order)."""
    t = _table(fmt)
    return t[: int(torch.isfinite(t[:128]).sum())].double()


def max_finite(fmt: str = "e4m3") -> float:
    """448 for E4M3fn, 57344 for E5M2."""
    return float(_positive(_check_format(fmt))[-1])


def nan_code(fmt: str = "e4m3") -> int:
    """The positive NaN code written for a NaN input: 0x7F (E4M3fn's only NaN; one of E5M2's three)."""
    _check_format(fmt)
    return 0x7F


def encode(x: torch.Tensor, fmt: str = "e4m3", rounding: str = "rne") -> torch.Tensor:
    """uint8 codes of x (no scale applied). Saturates beyond the largest finite value, NaN -> NaN code.

    rounding "rne" picks the nearer of the two neighbouring codes, the even one on a tie; "rtz" the
    one nearer zero. Works on magnitudes: the sign bit is copied (so -0.0 and tiny negatives give 0x80,
    as torch does)."""
    _check_format(fmt)
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {', '.join(ROUNDINGS)}, got {rounding!r}")
    values = _positive(fmt).to(x.device)
    top = values.numel() - 1
    a = x.detach().double().abs()
    nan = torch.isnan(a)
    a = torch.where(nan, 0.0, a).clamp(max=float(values[-1]))  # saturate (inf too)
    lo = (torch.searchsorted(values, a, right=True) - 1).clamp(0, top)  # largest value <= a
    if rounding == "rne":
        hi = (lo + 1).clamp(max=top)
        below, above = a - values[lo], values[hi] - a
        up = (above < below) | ((above == below) & (lo % 2 == 1) & (hi != lo))
        lo = torch.where(up, hi, lo)
    codes = lo.to(torch.uint8) | (torch.signbit(x.detach()).to(torch.uint8) << 7)
    return torch.where(nan, torch.tensor(nan_code(fmt), dtype=torch.uint8, device=x.device), codes)


def decode(codes: torch.Tensor, fmt: str = "e4m3", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of uint8 codes, by table lookup."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"fp8 codes must be uint8, got {codes.dtype}")
    return _table(_check_format(fmt)).to(codes.device)[codes.long()].to(dtype)


# ---------------------------------------------------------------------------------------------------
# Scales

def check_scale(scale, rule: str, num_tokens: int, num_heads: int) -> torch.Tensor:
    """scale as a float32 tensor of exactly its rule's shape: tensor (), head [H], token_head [T, H].

    Anything else raises: a scale is never broadcast or cast silently. So does a scale that is zero,
    negative, inf or NaN (it would turn every value into inf or NaN)."""
    if rule not in SCALE_RULES:
        raise ValueError(f"scale rule must be one of {', '.join(SCALE_RULES)}, got {rule!r}")
    expected = {"tensor": (), "head": (num_heads,), "token_head": (num_tokens, num_heads)}[rule]
    if isinstance(scale, bool) or not isinstance(scale, (int, float, torch.Tensor)):
        raise ValueError(f"scale must be a number or a tensor, got {scale!r}")
    s = scale if isinstance(scale, torch.Tensor) else torch.tensor(float(scale))
    if not s.dtype.is_floating_point:
        raise ValueError(f"scale must be a floating-point tensor, got {s.dtype}")
    if tuple(s.shape) != expected:
        raise ValueError(f"a per-{rule.replace('_', '-and-')} scale must have shape {expected}, got "
                         f"{tuple(s.shape)}")
    if not bool(torch.isfinite(s).all()) or bool((s <= 0).any()):
        raise ValueError(f"scale must be finite and > 0, got {s.flatten()[:8].tolist()}")
    return s.float()


def scale_rule_of(scale, num_tokens: int, num_heads: int) -> str:
    """Which rule a scale's shape fits (a number or () is per tensor); ValueError if none."""
    shape = tuple(scale.shape) if isinstance(scale, torch.Tensor) else ()
    for rule, expected in (("tensor", ()), ("head", (num_heads,)), ("token_head", (num_tokens, num_heads))):
        if shape == expected:
            return rule
    raise ValueError(f"scale shape {shape} fits no rule for {num_tokens} tokens x "
                     f"{num_heads} heads: per tensor (), per head ({num_heads},), per token and head "
                     f"({num_tokens}, {num_heads})")


def _broadcastable(scale: torch.Tensor, rule: str) -> torch.Tensor:
    """The checked scale shaped to multiply [T, H, D]."""
    if rule == "tensor":
        return scale
    return scale[None, :, None] if rule == "head" else scale[:, :, None]


def _check_kv(x: torch.Tensor) -> None:
    if x.dim() != 3:
        raise ValueError("expected K or V as [num_tokens, num_kv_heads, head_dim], "
                         f"got shape {tuple(x.shape)}")


def quantize(x: torch.Tensor, scale=1.0, fmt: str = "e4m3", rounding: str = "rne",
             rule: str | None = None) -> torch.Tensor:
    """Codes of x / scale for K or V [T, H, D]. rule (tensor, head, token_head) is taken from the
    scale's shape when not given; given, the shape must fit it."""
    _check_kv(x)
    rule = rule or scale_rule_of(scale, x.shape[0], x.shape[1])
    s = _broadcastable(check_scale(scale, rule, x.shape[0], x.shape[1]).to(x.device), rule)
    return encode(x.float() / s, fmt, rounding)


def dequantize(codes: torch.Tensor, scale=1.0, fmt: str = "e4m3", rule: str | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of codes [T, H, D] times their scale."""
    _check_kv(codes)
    rule = rule or scale_rule_of(scale, codes.shape[0], codes.shape[1])
    s = _broadcastable(check_scale(scale, rule, codes.shape[0], codes.shape[1]).to(codes.device), rule)
    return (decode(codes, fmt) * s).to(dtype)


def _amax_scale(amax: torch.Tensor, fmt: str, divisor: float | None = None) -> torch.Tensor:
    """amax / divisor (default: the format's largest finite); an all-zero tensor gets scale 1."""
    s = amax.float() / (max_finite(fmt) if divisor is None else divisor)
    return torch.where(s > 0, s, torch.ones_like(s))


def calibrated_scale(x: torch.Tensor, fmt: str = "e4m3", rule: str = "tensor") -> torch.Tensor:
    """Offline calibration: amax / largest finite, over the whole tensor () or per head [H] of x [T, H, D]
    (x: K or V collected over a calibration set)."""
    _check_kv(x)
    if rule == "tensor":
        amax = x.abs().amax()
    elif rule == "head":
        amax = x.abs().amax(dim=(0, 2))
    else:
        raise ValueError(f"calibrated scales are per tensor or per head, got rule {rule!r}")
    return _amax_scale(amax, fmt)


def dynamic_scale(x: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
    """A scale per token and head [T, H]: each head's vector uses the whole FP8 range."""
    _check_kv(x)
    return _amax_scale(x.abs().amax(dim=2), fmt)


def legacy_vllm_scales(k: torch.Tensor, v: torch.Tensor) -> tuple[float, float]:
    """Older vLLM's calculate_kv_scales, from one batch: (amax(k) / 200, amax(v) / 100). Not the
    format's range: these leave E4M3 headroom of 448 / 200 = 2.24x for later, larger keys."""
    _check_kv(k), _check_kv(v)
    return (float(_amax_scale(k.abs().amax(), "e4m3", LEGACY_K_DIVISOR)),
            float(_amax_scale(v.abs().amax(), "e4m3", LEGACY_V_DIVISOR)))
