"""INT4 group-wise: groups of g values along the last axis share a scale (and, asymmetric, a zero point).

- symmetric: scale = amax / 7, q = round(x / scale) in [-8, 7], stored as q + 8; x ~ (q - 8) x scale.
- asymmetric: zero = min, scale = (max - min) / 15, q = round((x - zero) / scale) in [0, 15];
  x ~ q x scale + zero. One more number per group, a finer grid when the group is lopsided.

Two 4-bit codes share a byte: element 2i in the low nibble, 2i + 1 in the high one. Scales and zero
points are stored in fp16 (2 bytes) or FP8 E4M3 (1 byte, as uint8 codes); the values are quantized with
the stored (rounded) scale and zero, so that dequantizing uses exactly what quantizing used. FP8 scales
are rounded up and FP8 zero points down, so the stored grid still covers the group; fp16's rounding
is finer than half a step and the clamp absorbs it.

int8 zero points (int8_zeros): the zero is an integer code z = round(-min / scale) in int8 and
x ~ (q - z) x scale, so 0.0 is exactly on the grid and the zero costs one byte whatever the scale
dtype. The scale is at least amax / 127, so z always fits int8 (a group far from zero, narrow
against its offset, gets a coarser grid rather than a clipped one); the error stays within half a step.

Along head_dim (a token's K or V of one head) this is the classic per-token INT4 KV; along tokens
(keys per channel) it is KIVI's key layout (radarlab.quant.kivi).
"""
from __future__ import annotations

import torch

from radarlab.quant import fp8
from radarlab.quant.formats import SCALE_DTYPES
from radarlab.util import require_int

FP16_MAX = 65504.0
SMALLEST_SCALE = {"fp16": 2.0**-24, "fp8": 2.0**-9}  # the smallest positive scale each dtype stores


def check_group(group_size, dim: int) -> int:
    """A group must divide the axis it runs along (a group never straddles two heads)."""
    g = require_int("group_size", group_size)
    if dim % g:
        raise ValueError(f"group_size ({g}) must divide the grouped axis ({dim}); try one of "
                         f"{[d for d in (8, 16, 32, 64, 128, 256) if dim % d == 0]}")
    return g


def _check_scale_dtype(scale_dtype: str) -> str:
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"scale_dtype must be one of {', '.join(SCALE_DTYPES)}, got {scale_dtype!r}")
    return scale_dtype


def pack(q: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [..., n] (n even) -> bytes [..., n / 2], element 2i in the low nibble."""
    if q.dtype != torch.uint8 or q.shape[-1] % 2:
        raise ValueError(f"pack takes uint8 codes with an even last axis, got {q.dtype} {tuple(q.shape)}")
    if bool((q > 15).any()):
        raise ValueError("pack takes 4-bit codes (0..15)")
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """bytes [..., m] -> codes [..., 2m]: the inverse of pack."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack takes uint8, got {packed.dtype}")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


def store_meta(x: torch.Tensor, scale_dtype: str, direction: str = "nearest") -> torch.Tensor:
    """Scales or zero points as stored: fp16, or FP8 E4M3 codes (uint8) rounded up / down / nearest."""
    if _check_scale_dtype(scale_dtype) == "fp16":
        return x.clamp(-FP16_MAX, FP16_MAX).to(torch.float16)  # saturate: an inf scale would decode to inf
    codes = fp8.encode(x, "e4m3", "rne")
    if direction == "nearest":
        return codes
    value = fp8.decode(codes)
    wrong = value < x if direction == "up" else value > x
    # One code step: codes are ordered by magnitude within a sign; +0 steps down to the smallest negative.
    neg, mag = codes >> 7, codes & 0x7F
    # up: a positive value grows (away from zero), a negative one shrinks; down: the other way round
    grows = (neg == 1) | (mag == 0) if direction == "down" else neg == 0
    away = wrong & grows & (mag < 0x7E)  # the largest finite code saturates: one step further is NaN
    toward = wrong & ~grows & (mag > 0)
    stepped = torch.where(away & (mag == 0), torch.full_like(codes, 0x81 if direction == "down" else 0x01),
                          torch.where(away, codes + 1, codes - 1))
    return torch.where(away | toward, stepped, codes)


def load_meta(stored: torch.Tensor, scale_dtype: str) -> torch.Tensor:
    """Stored scales or zero points back to float32."""
    if _check_scale_dtype(scale_dtype) == "fp16":
        return stored.float()
    return fp8.decode(stored)


def quantize_codes(x: torch.Tensor, group_size: int, symmetric: bool = True, scale_dtype: str = "fp16",
                   int8_zeros: bool = False):
    """x [..., n] -> (codes uint8 0..15 [..., n], scales [..., n/g], zeros [..., n/g] or None), unpacked.

    Scales and zeros are stored as scale_dtype (fp16 tensors or E4M3 uint8 codes); int8_zeros (asym)
    stores integer zero points as int8 instead. A NaN in a group
    makes its scale NaN, so the group decodes to NaN: the bad value stays visible."""
    n = x.shape[-1]
    g = check_group(group_size, n)
    xg = x.float().reshape(*x.shape[:-1], n // g, g)
    tiny = SMALLEST_SCALE[_check_scale_dtype(scale_dtype)]
    if symmetric:
        scale = (xg.abs().amax(-1) / 7).clamp(min=tiny)
        s_stored = store_meta(scale, scale_dtype, "up")
        s = load_meta(s_stored, scale_dtype)[..., None]
        q = (torch.round(xg / s).clamp(-8, 7) + 8)
        z_stored = None
    elif int8_zeros:
        lo, hi = xg.amin(-1), xg.amax(-1)
        step = torch.maximum((hi - lo) / 15, torch.maximum(hi.abs(), lo.abs()) / 127).clamp(min=tiny)
        s_stored = store_meta(step, scale_dtype, "up")
        s = load_meta(s_stored, scale_dtype)
        z_stored = torch.nan_to_num(torch.round(-lo / s), nan=0.0).clamp(-128, 127).to(torch.int8)
        q = torch.round(xg / s[..., None] + z_stored[..., None].float()).clamp(0, 15)
    else:
        lo, hi = xg.amin(-1), xg.amax(-1)
        z_stored = store_meta(lo, scale_dtype, "down")
        z = load_meta(z_stored, scale_dtype)
        s_stored = store_meta(((hi - z) / 15).clamp(min=tiny), scale_dtype, "up")
        s = load_meta(s_stored, scale_dtype)[..., None]
        q = torch.round((xg - z[..., None]) / s).clamp(0, 15)
    return torch.nan_to_num(q, nan=0.0).to(torch.uint8).reshape(x.shape), s_stored, z_stored


def dequantize_codes(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
                     scale_dtype: str = "fp16", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unpacked codes [..., n] back to values; symmetric when zeros is None."""
    n = q.shape[-1]
    g = check_group(group_size, n)
    if tuple(scales.shape) != (*q.shape[:-1], n // g):
        raise ValueError(f"scales must have shape {(*q.shape[:-1], n // g)} for groups of {g}, got "
                         f"{tuple(scales.shape)}")
    if zeros is not None and zeros.shape != scales.shape:
        raise ValueError(f"zeros must have the scales' shape {tuple(scales.shape)}, got {tuple(zeros.shape)}")
    qg = q.float().reshape(*q.shape[:-1], n // g, g)
    s = load_meta(scales, scale_dtype)[..., None]
    if zeros is None:
        x = (qg - 8) * s
    elif zeros.dtype == torch.int8:  # an integer zero point: x = (q - z) * s
        x = (qg - zeros.float()[..., None]) * s
    else:
        x = qg * s + load_meta(zeros, scale_dtype)[..., None]
    return x.reshape(q.shape).to(dtype)


def quantize(x: torch.Tensor, group_size: int, symmetric: bool = True, scale_dtype: str = "fp16",
             int8_zeros: bool = False):
    """x [..., n] -> (packed uint8 [..., n/2], scales [..., n/g], zeros [..., n/g] or None)."""
    if x.shape[-1] % 2:
        raise ValueError(f"the grouped axis must be even to pack two values per byte, got {x.shape[-1]}")
    if int8_zeros and symmetric:
        raise ValueError("int8_zeros needs asymmetric groups (symmetric ones have no zero point)")
    q, scales, zeros = quantize_codes(x, group_size, symmetric, scale_dtype, int8_zeros)
    return pack(q), scales, zeros


def dequantize(packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int,
               scale_dtype: str = "fp16", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of quantize; symmetric when zeros is None."""
    return dequantize_codes(unpack(packed), scales, zeros, group_size, scale_dtype, dtype)
