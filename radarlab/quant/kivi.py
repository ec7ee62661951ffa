"""KIVI: keys quantized per channel, in groups of g tokens; values per token; recent tokens in 16-bit.

Keys have outlier channels (a few of head_dim's channels are large for every token), so a scale per
token must cover the outlier and crushes the rest. KIVI groups keys the other way: one scale and zero
point per channel, shared by g consecutive tokens. Values have no such channels and are grouped per
token along head_dim, as in int4.py. Both are asymmetric INT4.

A key group can only be quantized once its g tokens exist, so the newest tokens wait in 16-bit: the
last partial group, plus a residual window of `residual` tokens KIVI keeps unquantized on purpose
(the newest tokens matter most to the next query). With T tokens, the first
quantized_length(T, g, residual) = floor((T - residual) / g) x g are quantized, the rest stay 16-bit.

That is radarlab's rule, the same for keys and values, and the paged cache's (kivi_store.py): at least
`residual` tokens stay 16-bit. KIVI's own code (jy-yuan/KIVI, models/llama_kivi.py) keeps fewer keys:
it quantizes keys R = residual at a time, so T mod R of them wait in 16-bit, and keeps exactly the
newest R values (a sliding window, a value quantized as it leaves). quantized_lengths(..., rule="kivi")
gives those counts, and quantize(..., rule="kivi") applies them.

A cache can take its quantizers, its dequantizers and its quantized_length from elsewhere (KiviQuantizer:
the seam a learner's code plugs into, Engine(kivi_quantizer=...)).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from radarlab.quant import int4
from radarlab.util import require_int


def quantized_length(num_tokens: int, group_size: int, residual: int = 0) -> int:
    """How many of num_tokens are quantized: whole groups, leaving at least `residual` tokens in 16-bit."""
    n = require_int("num_tokens", num_tokens, minimum=0)
    g = require_int("group_size", group_size)
    r = require_int("residual", residual, minimum=0)
    return max(0, n - r) // g * g


RULES = ("radarlab", "kivi")


def quantized_lengths(num_tokens: int, group_size: int, residual: int = 0, rule: str = "radarlab"):
    """(keys, values) quantized of num_tokens. "radarlab": quantized_length for both. "kivi" (KIVI's code):
    keys in whole windows of residual tokens (residual a multiple of group_size), values all but the
    newest residual."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    n = quantized_length(num_tokens, group_size, residual)
    if rule == "radarlab":
        return n, n
    if residual == 0 or residual % group_size:
        raise ValueError(f"KIVI's rule quantizes keys {residual} tokens at a time: the residual must be a "
                         f"positive multiple of group_size ({group_size}), got {residual}")
    return num_tokens // residual * residual, max(0, num_tokens - residual)


def quantize_key_codes(k: torch.Tensor, group_size: int, scale_dtype: str = "fp16", int8_zeros: bool = False):
    """Keys [T, H, D], T a multiple of g -> (codes uint8 [T, H, D] unpacked, scales [T/g, H, D], zeros
    [T/g, H, D]) as the cache stores them: each (token group, head, channel) one asymmetric int4 group
    of g values along tokens. The paged cache packs the codes (KiviQuantizer's contract)."""
    t, h, d = k.shape
    g = int4.check_group(group_size, t)
    per_channel = k.reshape(t // g, g, h, d).permute(0, 2, 3, 1)  # [T/g, H, D, g]
    q, scales, zeros = int4.quantize_codes(per_channel, g, symmetric=False, scale_dtype=scale_dtype,
                                           int8_zeros=int8_zeros)
    return q.permute(0, 3, 1, 2).reshape(t, h, d), scales[..., 0], zeros[..., 0]


def quantize_keys(k: torch.Tensor, group_size: int, scale_dtype: str = "fp16", int8_zeros: bool = False):
    """Keys [T, H, D], T a multiple of g -> (packed [T, H, D/2], scales [T/g, H, D], zeros [T/g, H, D]).

    Each (token group, head, channel) is one asymmetric int4 group of g values along tokens. The codes
    are packed along head_dim, like every other 4-bit format, so a token's key stays one row."""
    codes, scales, zeros = quantize_key_codes(k, group_size, scale_dtype, int8_zeros)
    return int4.pack(codes), scales, zeros


def dequantize_key_codes(codes, scales, zeros, group_size: int, scale_dtype: str = "fp16",
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unpacked key codes [..., T, H, D] back to values, with scales and zeros [..., T/g, H, D]."""
    *lead, t, h, d = codes.shape
    g = int4.check_group(group_size, t)
    if tuple(scales.shape) != (*lead, t // g, h, d) or zeros.shape != scales.shape:
        raise ValueError(f"key scales and zeros must be {(*lead, t // g, h, d)}, got "
                         f"{tuple(scales.shape)} and {tuple(zeros.shape)}")
    qg = codes.float().reshape(*lead, t // g, g, h, d)
    s = int4.load_meta(scales, scale_dtype)[..., None, :, :]
    if zeros.dtype == torch.int8:  # integer zero points (int8zeros)
        x = (qg - zeros.float()[..., None, :, :]) * s
    else:
        x = qg * s + int4.load_meta(zeros, scale_dtype)[..., None, :, :]
    return x.reshape(codes.shape).to(dtype)


def dequantize_keys(packed, scales, zeros, group_size: int, scale_dtype: str = "fp16",
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of quantize_keys: [T, H, D] (any leading axes before T's groups work the same)."""
    return dequantize_key_codes(int4.unpack(packed), scales, zeros, group_size, scale_dtype, dtype)


def quantize_value_codes(v: torch.Tensor, group_size: int, scale_dtype: str = "fp16",
                         int8_zeros: bool = False):
    """Values [T, H, D] -> (codes uint8 [T, H, D] unpacked, scales [T, H, D/g], zeros [T, H, D/g]): per
    token, asymmetric int4 over groups of g channels along head_dim (values have no outlier channels)."""
    return int4.quantize_codes(v, group_size, False, scale_dtype, int8_zeros)


def dequantize_value_codes(codes, scales, zeros, group_size: int, scale_dtype: str = "fp16",
                           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of quantize_value_codes."""
    return int4.dequantize_codes(codes, scales, zeros, group_size, scale_dtype, dtype)


@dataclass
class KiviKV:
    """One head set's K and V under KIVI: the quantized prefixes and the 16-bit tails (under KIVI's rule
    keys and values have prefixes of different lengths)."""

    group_size: int
    scale_dtype: str
    keys: tuple  # quantize_keys' (packed [n, H, D/2], scales [n/g, H, D], zeros)
    values: tuple  # int4.quantize's (packed, scales, zeros), values grouped per token along head_dim
    k_tail: torch.Tensor  # [tail, H, D] in 16-bit
    v_tail: torch.Tensor

    @property
    def num_quantized(self) -> int:
        return self.keys[0].shape[0]

    @property
    def nbytes(self) -> int:
        """Every byte it holds: codes, scales, zero points and the 16-bit tails."""
        return sum(t.nbytes for t in (*self.keys, *self.values, self.k_tail, self.v_tail))


def quantize(k: torch.Tensor, v: torch.Tensor, group_size: int = 32, residual: int = 0,
             scale_dtype: str = "fp16", tail_dtype: torch.dtype = torch.float16,
             rule: str = "radarlab") -> KiviKV:
    """KIVI-quantize K and V [T, H, D]: the prefixes quantized_lengths(..., rule) gives are quantized,
    the rest kept in tail_dtype."""
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"k and v must both be [num_tokens, num_kv_heads, head_dim], got {tuple(k.shape)} "
                         f"and {tuple(v.shape)}")
    int4.check_group(group_size, k.shape[2])  # values are grouped along head_dim
    nk, nv = quantized_lengths(k.shape[0], group_size, residual, rule)
    return KiviKV(group_size, scale_dtype, quantize_keys(k[:nk], group_size, scale_dtype),
                  int4.quantize(v[:nv], group_size, symmetric=False, scale_dtype=scale_dtype),
                  k[nk:].to(tail_dtype), v[nv:].to(tail_dtype))


def dequantize(kv: KiviKV, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [T, H, D] back: the dequantized prefixes followed by the tails."""
    g = kv.group_size
    k = dequantize_keys(*kv.keys, g, kv.scale_dtype, dtype)
    v = int4.dequantize(*kv.values, g, kv.scale_dtype, dtype)
    return torch.cat((k, kv.k_tail.to(dtype))), torch.cat((v, kv.v_tail.to(dtype)))


@dataclass(frozen=True)
class KiviQuantizer:
    """The pieces of KIVI a paged cache takes as arguments, so that one's own (a learner's, notebook 07)
    runs in the real engine: Engine(kivi_quantizer=...) -> PagedKVCache -> KiviStore. Codes are
    unpacked uint8 in 0..15 (the cache packs them), scales and zeros in the dtypes the cache's format
    stores (fp16 for kivi_g32); None: radarlab's function for the format.

    quantize_keys(k [T, H, D], g) -> (codes [T, H, D], scales [T/g, H, D], zeros [T/g, H, D]): per
    channel, over groups of g tokens. quantize_values(v [T, H, D], g) -> (codes [T, H, D], scales
    [T, H, D/g], zeros [T, H, D/g]): per token, over groups of g channels. dequantize_keys and
    dequantize_values(codes, scales, zeros, g) -> float32 [T, H, D]: how attention reads them back.
    quantized_length(num_tokens, g, residual) -> how many of a sequence's tokens are quantized, whole
    groups. The cache checks each given function once, on a probe, when it is built."""

    quantize_keys: Callable | None = None
    quantized_length: Callable = quantized_length
    quantize_values: Callable | None = None
    dequantize_keys: Callable | None = None
    dequantize_values: Callable | None = None

    def resolved(self, scale_dtype: str = "fp16", int8_zeros: bool = False) -> "KiviQuantizer":
        """Every function filled in: the given ones, and radarlab's, for a format storing its scales as
        scale_dtype (int8 zero points with int8_zeros), where none is given."""
        sd, z8 = scale_dtype, int8_zeros
        return KiviQuantizer(
            self.quantize_keys or (lambda k, g: quantize_key_codes(k, g, sd, z8)),
            self.quantized_length,
            self.quantize_values or (lambda v, g: quantize_value_codes(v, g, sd, z8)),
            self.dequantize_keys or (lambda c, s, z, g: dequantize_key_codes(c, s, z, g, sd)),
            self.dequantize_values or (lambda c, s, z, g: dequantize_value_codes(c, s, z, g, sd)))
