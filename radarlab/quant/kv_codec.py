"""Encode and decode K or V vectors in any per-token format of the table: what the cache's write and
attention's read call, whatever the format.

A format's stored form is a payload plus, where the format has them, scales and zero points beside it:

    format                 payload [..., H, Dp]        scales [..., H, S]        zeros
    float16 / bfloat16     the values (Dp = D)         -                         -
    fp8 (tensor rule)      E4M3/E5M2 codes (D)         - (k_scale/v_scale: () or [H], passed in)
    fp8_per_token_head     E4M3 codes (D)              fp16 [.., H, 1]           -
    int4 (g, sym/asym)     two codes a byte (D / 2)    fp16 or E4M3 [.., H, D/g]  asym: like scales,
                                                                               or int8 (int8zeros)

KIVI's keys are grouped along tokens, not along head_dim; the paged cache stores them block by block
with radarlab.quant.kivi (values are int4 asym, which this module encodes).
"""
from __future__ import annotations

import torch

from radarlab.quant import fp8, int4
from radarlab.quant.formats import KVFormat

STATIC_SCALE_RULES = {0: "tensor", 1: "head"}  # a static fp8 scale: () or [H]


def payload_width(fmt: KVFormat, head_dim: int) -> int:
    """Dp: bytes (or values) one head vector's payload takes along the last axis."""
    return head_dim // 2 if fmt.is_packed else head_dim


def scale_width(fmt: KVFormat, head_dim: int) -> int:
    """S: scales stored per token and head (0: none stored, the scale is static or there is none)."""
    if fmt.kind in ("int4", "kivi"):
        return head_dim // fmt.group_size
    return 1 if fmt.scale_rule == "token_head" else 0


def meta_dtype(fmt: KVFormat) -> torch.dtype:
    """How scales and zero points are stored: fp16, or E4M3 codes in uint8."""
    return torch.uint8 if fmt.scale_dtype == "fp8" else torch.float16


def zero_dtype(fmt: KVFormat) -> torch.dtype:
    """How zero points are stored: int8 codes (int8zeros), else as the scales."""
    return torch.int8 if fmt.int8_zeros else meta_dtype(fmt)


def check_static_scale(scale, num_heads: int) -> torch.Tensor:
    """An fp8 tensor-rule scale: a number, () or [H]; finite and > 0 (fp8.check_scale's rules)."""
    shape = tuple(scale.shape) if isinstance(scale, torch.Tensor) else ()
    if shape not in ((), (num_heads,)):
        raise ValueError(f"a static fp8 scale is per tensor () or per head ({num_heads},), got shape {shape}")
    return fp8.check_scale(scale, STATIC_SCALE_RULES[len(shape)], 1, num_heads)


def _static(scale: torch.Tensor) -> torch.Tensor:
    """() stays (), [H] becomes [H, 1] to multiply [..., H, D]."""
    return scale if scale.dim() == 0 else scale[:, None]


def encode_kv(x: torch.Tensor, fmt: KVFormat, scale=1.0):
    """x [T, H, D] -> (payload [T, H, Dp], scales [T, H, S] or None, zeros or None).

    scale is the static fp8 scale (k_scale or v_scale); it must be 1.0 for the other formats."""
    if x.dim() != 3:
        raise ValueError(f"expected K or V as [num_tokens, num_kv_heads, head_dim], got {tuple(x.shape)}")
    fmt.check_head_dim(x.shape[2])
    if fmt.kind == "float":
        return x.to(fmt.storage_dtype or x.dtype), None, None
    if fmt.kind == "fp8":
        if fmt.scale_rule == "token_head":
            s = fp8.dynamic_scale(x, fmt.fp8).half()  # stored in fp16, so encode with the stored value
            return fp8.quantize(x, s.float(), fmt.fp8, fmt.rounding, "token_head"), s[..., None], None
        s = check_static_scale(scale, x.shape[1]).to(x.device)
        return fp8.encode(x.float() / _static(s), fmt.fp8, fmt.rounding), None, None
    return int4.quantize(x, fmt.group_size, fmt.symmetric, fmt.scale_dtype, fmt.int8_zeros)


def decode_kv(payload: torch.Tensor, scales, zeros, fmt: KVFormat, scale=1.0) -> torch.Tensor:
    """float32 [..., H, D] from a stored form (any leading axes: tokens, or blocks x rows)."""
    if fmt.kind == "float":
        return payload.float()
    if fmt.kind == "fp8":
        values = fp8.decode(payload, fmt.fp8)
        if fmt.scale_rule == "token_head":
            return values * scales.float()
        return values * _static(check_static_scale(scale, payload.shape[-2]).to(payload.device))
    return int4.dequantize(payload, scales, zeros, fmt.group_size, fmt.scale_dtype)


class QuantizedPool:
    """One layer's K or V pool in an encoded format, read as if it were [num_blocks, block_size, H, D].

    payload [N, B, H, Dp] and scales / zeros [N, B, H, S] are block-shaped, so one block id indexes all
    of them; `scale` is the static fp8 scale (() or [H]). Indexing with block ids (pool[blocks])
    dequantizes only those blocks, to float32: attention in torch reads a quantized pool exactly as it
    reads a plain one, and nothing decodes the whole pool. write() encodes and scatters new tokens.
    """

    def __init__(self, fmt: KVFormat, payload: torch.Tensor, scales: torch.Tensor | None = None,
                 zeros: torch.Tensor | None = None, scale=1.0, head_dim: int | None = None) -> None:
        if payload.dim() != 4:
            raise ValueError("payload must be [num_blocks, block_size, num_kv_heads, width], "
                             f"got {tuple(payload.shape)}")
        self.fmt, self.payload, self.scales, self.zeros = fmt, payload, scales, zeros
        d = head_dim if head_dim is not None else payload.shape[-1] * (2 if fmt.is_packed else 1)
        self.head_dim = fmt.check_head_dim(d)
        if payload.shape[-1] != payload_width(fmt, d):
            raise ValueError(f"{fmt.name} stores {payload_width(fmt, d)} payload entries per head vector, "
                             f"payload has {payload.shape[-1]}")
        s = scale_width(fmt, d)
        for name, t, needed in (("scales", scales, s > 0),
                                ("zeros", zeros, fmt.is_packed and not fmt.symmetric)):
            if needed and (t is None or tuple(t.shape) != (*payload.shape[:3], s)):
                raise ValueError(f"{fmt.name} needs {name} of shape "
                                 f"{(*payload.shape[:3], s)} beside the payload, got "
                                 f"{None if t is None else tuple(t.shape)}")
        self.scale = check_static_scale(scale, payload.shape[2]).to(payload.device) if fmt.kind == "fp8" \
            and fmt.scale_rule == "tensor" else None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.payload.shape[:3], self.head_dim))

    def dim(self) -> int:
        return 4

    @property
    def device(self) -> torch.device:
        return self.payload.device

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32  # what reads return

    def __getitem__(self, blocks) -> torch.Tensor:
        def pick(t):
            return None if t is None else t[blocks]

        return decode_kv(self.payload[blocks], pick(self.scales), pick(self.zeros), self.fmt,
                         1.0 if self.scale is None else self.scale)

    def write(self, x: torch.Tensor, slots: torch.Tensor) -> None:
        """Encode x [T, H, D] and store it at slots [T] (all valid: the caller drops padding)."""
        payload, scales, zeros = encode_kv(x, self.fmt, 1.0 if self.scale is None else self.scale)
        for dst, src in ((self.payload, payload), (self.scales, scales), (self.zeros, zeros)):
            if src is not None:
                dst.view(-1, *dst.shape[2:])[slots] = src
