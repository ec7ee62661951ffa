"""Triton kernels for quantized paged caches: the write that quantizes, and decode / prefill attention
that dequantizes each tile of K and V as it loads it. The whole pool is never decoded.

The pools are PagedKVCache.layer_pools views: QuantizedPool (radarlab.quant.kv_codec), a uint8 payload
[N, B, H, Dp] and, where the format stores them, block-shaped scales and zero points [N, B, H, S];
KiviPool (radarlab.kvcache.kivi_store); either one inside a SinkPool. Three kinds of load:

- fp8 (KIND 1): a byte is a code; its value comes from the 256-entry decode table, times the static
  scale of the head (k_scale / v_scale) or the token's own scale (fp8_per_token_head);
- int4 (KIND 2): element d lives in byte d // 2, low nibble for even d; times its group's scale
  (fp16, or an E4M3 code looked up in the same kind of table), plus the zero point when asymmetric,
  or minus an int8 zero code (int8zeros). KIVI's values are this kind;
- KIVI keys (KIND 3): packed as int4, but the scale and zero point are per channel, shared by the g
  tokens of a key group: [N, B/g, H, D].

Over the codes go the 16-bit rows a cache keeps: KIVI's tails (a group not yet quantized), this step's
groups as they were before the write quantized them (so that query t reads only the key groups that
were complete when t was the newest token: attention_settled's rule), and the sinks (a sequence's first
tokens). 16-bit pools go through triton_paged.py's kernels, which need none of this.

The write encodes exactly as radarlab.quant does in torch, so the two paths store the same bytes:
FP8 by a binary search over the format's 127 (or 124) finite non-negative values, then round to
nearest even or toward zero; INT4 by group amax (or min and max), the scale stored in fp16 or FP8
(rounded up, zero points down) before the values are divided by it, half-to-even rounding, two codes
packed a byte; KIVI keys the same way over each channel of a group. Which KIVI groups a step quantizes
(and the tails) is decided on the host once per step (KiviStore.begin_step); a sink's 16-bit copy is a
plain row copy (SinkStore.write). Everything is fp32 inside. The torch references are reshape_and_cache
and KiviStore's torch write, and paged_attention_torch over the same pools;
tests/attention/test_quant_triton.py runs both under the interpreter. Head dims must be powers of two
here (no padded lanes inside a group).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from radarlab.attention.layout import validate_block_tables, validate_pool, validate_slot_mapping
from radarlab.attention.triton_paged import prefill_tile
from radarlab.kvcache.block_table import group_slots
from radarlab.kvcache.kivi_store import KiviPool
from radarlab.kvcache.sink_store import SinkPool
from radarlab.quant import fp8, int4
from radarlab.quant.kv_codec import QuantizedPool
from radarlab.util import require_power_of_two


def _pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, triton.next_power_of_2(int(n)))


# --------------------------------------------------------------------------------------------------
# Encoding helpers (device side)
# --------------------------------------------------------------------------------------------------
@triton.jit
def _fp8_encode(x, pos_ptr, TOP: tl.constexpr, RTZ: tl.constexpr):
    """int32 FP8 codes of fp32 x: saturating, NaN -> 0x7F, RNE or RTZ. pos_ptr: the finite
    non-negative values, ascending (index = code); TOP the largest finite code."""
    nan = x != x
    a = tl.where(nan, 0.0, tl.abs(x))
    a = tl.minimum(a, tl.load(pos_ptr + TOP))
    lo = tl.zeros(a.shape, tl.int32)
    for i in tl.static_range(7):  # binary search: the largest index whose value is <= a
        cand = lo + (64 >> i)
        v = tl.load(pos_ptr + tl.minimum(cand, TOP))
        lo = tl.where((cand <= TOP) & (v <= a), cand, lo)
    if not RTZ:
        hi = tl.minimum(lo + 1, TOP)
        below = a - tl.load(pos_ptr + lo)
        above = tl.load(pos_ptr + hi) - a
        up = (above < below) | ((above == below) & (lo % 2 == 1) & (hi != lo))
        lo = tl.where(up, hi, lo)
    sign = (x.to(tl.int32, bitcast=True) < 0).to(tl.int32)
    return tl.where(nan, 0x7F, lo | (sign << 7))


@triton.jit
def _store_meta(x, pos_ptr, table_ptr, SCALE_FP8: tl.constexpr, UP: tl.constexpr):
    """A scale (UP) or zero point (not UP) as stored: fp16, or an E4M3 code moved one step so that the
    stored value is >= x (scales) or <= x (zero points). Returns (stored, its fp32 value)."""
    if SCALE_FP8:
        code = _fp8_encode(x, pos_ptr, 126, False)
        val = tl.load(table_ptr + code)
        neg = code >> 7
        mag = code & 0x7F
        if UP:
            wrong = val < x
            grows = neg == 0
            edge = 0x01
        else:
            wrong = val > x
            grows = (neg == 1) | (mag == 0)
            edge = 0x81
        away = wrong & grows & (mag < 0x7E)  # saturated: one step further is NaN
        toward = wrong & (~grows) & (mag > 0)
        stepped = tl.where(away & (mag == 0), edge, tl.where(away, code + 1, code - 1))
        code = tl.where(away | toward, stepped, code)
        return code.to(tl.uint8), tl.load(table_ptr + code)
    h = tl.minimum(tl.maximum(x, -65504.0), 65504.0).to(tl.float16)  # saturate, as int4.store_meta
    return h, h.to(tl.float32)


@triton.jit
def _round_half_even(y):
    r = tl.floor(y)
    frac = y - r
    up = (frac > 0.5) | ((frac == 0.5) & (r % 2 != 0))
    return tl.where(up, r + 1.0, r)


@triton.jit
def _asym_meta(lo, hi, meta_pos_ptr, meta_table_ptr, SCALE_FP8: tl.constexpr, INT8_ZEROS: tl.constexpr,
               TINY: tl.constexpr):
    """An asymmetric group's (stored scale, its fp32 value, stored zero point) from its min and max, as
    int4.quantize_codes makes them: a float zero (the min, rounded down), or an int8 code (int8zeros)."""
    if INT8_ZEROS:
        step = tl.maximum(tl.div_rn(hi - lo, tl.full(hi.shape, 15.0, tl.float32)),
                          tl.div_rn(tl.maximum(tl.abs(hi), tl.abs(lo)), tl.full(hi.shape, 127.0, tl.float32)))
        s_stored, s = _store_meta(tl.maximum(step, TINY), meta_pos_ptr, meta_table_ptr, SCALE_FP8, True)
        z = _round_half_even(tl.div_rn(-lo, s))
        z = tl.minimum(tl.maximum(tl.where(z == z, z, 0.0), -128.0), 127.0)
        return s_stored, s, z.to(tl.int8)
    z_stored, z = _store_meta(lo, meta_pos_ptr, meta_table_ptr, SCALE_FP8, False)
    span = tl.div_rn(hi - z, tl.full(hi.shape, 15.0, tl.float32))
    s_stored, s = _store_meta(tl.maximum(span, TINY), meta_pos_ptr, meta_table_ptr, SCALE_FP8, True)
    return s_stored, s, z_stored


@triton.jit
def _asym_codes(x, s, z_stored, meta_table_ptr, SCALE_FP8: tl.constexpr, INT8_ZEROS: tl.constexpr):
    """Codes 0..15 (fp32) of x under a group's scale s (fp32) and stored zero point (broadcastable)."""
    if INT8_ZEROS:
        y = tl.div_rn(x, s) + z_stored.to(tl.float32)
    else:
        y = tl.div_rn(x - _load_zero(z_stored, meta_table_ptr, SCALE_FP8), s)
    return tl.minimum(tl.maximum(_round_half_even(y), 0.0), 15.0)


@triton.jit
def _load_zero(z_stored, meta_table_ptr, SCALE_FP8: tl.constexpr):
    if SCALE_FP8:
        return tl.load(meta_table_ptr + z_stored.to(tl.int32))
    return z_stored.to(tl.float32)


# --------------------------------------------------------------------------------------------------
# 1. The quantizing write
# --------------------------------------------------------------------------------------------------
@triton.jit
def _quant_write_kernel(
    x_ptr, slot_ptr, payload_ptr, scales_ptr, zeros_ptr, static_ptr, pos_ptr, table_ptr, meta_pos_ptr,
    meta_table_ptr, num_tokens, num_kv_heads,
    stride_xt, stride_xh, stride_xd,
    stride_pb, stride_ps, stride_ph, stride_pd,
    stride_mb, stride_ms, stride_mh, stride_md,
    static_h,
    BLOCK_SIZE: tl.constexpr, TOKENS: tl.constexpr, HEADS_PAD: tl.constexpr, DIM: tl.constexpr,
    KIND: tl.constexpr, TOP: tl.constexpr, MAX_FINITE: tl.constexpr, RTZ: tl.constexpr,
    TOKEN_SCALE: tl.constexpr,
    QGROUP: tl.constexpr, SYMMETRIC: tl.constexpr, SCALE_FP8: tl.constexpr, INT8_ZEROS: tl.constexpr,
    TINY: tl.constexpr,
):
    """Quantize TOKENS tokens' [H, D] of K or V and store codes (and scales) at their slots."""
    tokens = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    slots = tl.load(slot_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    blocks = slots // BLOCK_SIZE
    rows = slots % BLOCK_SIZE
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, DIM)
    tok_ok = slots >= 0
    th_ok = tok_ok[:, None] & (h < num_kv_heads)[None, :]  # [TOKENS, HEADS]
    mask = th_ok[:, :, None]
    x = tl.load(x_ptr + tokens[:, None, None] * stride_xt + h[None, :, None] * stride_xh
                + d[None, None, :] * stride_xd, mask=mask, other=0.0).to(tl.float32)
    pbase = (blocks * stride_pb + rows * stride_ps)[:, None] + h[None, :] * stride_ph  # [TOKENS, HEADS]
    mbase = (blocks * stride_mb + rows * stride_ms)[:, None] + h[None, :] * stride_mh
    if KIND == 1:
        if TOKEN_SCALE:
            amax = tl.max(tl.abs(x), axis=2)
            s = tl.div_rn(amax, tl.full(amax.shape, MAX_FINITE, tl.float32))
            s = tl.where(s > 0, s, 1.0).to(tl.float16)
            tl.store(scales_ptr + mbase, s, mask=th_ok)
            s = s.to(tl.float32)
        else:
            s = tl.load(static_ptr + h * static_h, mask=h < num_kv_heads, other=1.0)[None, :]
        codes = _fp8_encode(tl.div_rn(x, s[:, :, None]), pos_ptr, TOP, RTZ)
        tl.store(payload_ptr + pbase[:, :, None] + d[None, None, :] * stride_pd, codes.to(tl.uint8),
                 mask=mask)
    else:
        NG: tl.constexpr = DIM // QGROUP
        xg = tl.reshape(x, [TOKENS, HEADS_PAD, NG, QGROUP])
        if SYMMETRIC:
            amax = tl.max(tl.abs(xg), axis=3)
            scale = tl.maximum(tl.div_rn(amax, tl.full(amax.shape, 7.0, tl.float32)), TINY)
            s_stored, s = _store_meta(scale, meta_pos_ptr, meta_table_ptr, SCALE_FP8, True)
            q = tl.minimum(tl.maximum(_round_half_even(tl.div_rn(xg, s[:, :, :, None])), -8.0), 7.0) + 8.0
        else:
            lo = tl.min(xg, axis=3)
            hi = tl.max(xg, axis=3)
            s_stored, s, z_stored = _asym_meta(lo, hi, meta_pos_ptr, meta_table_ptr, SCALE_FP8, INT8_ZEROS,
                                               TINY)
            q = _asym_codes(xg, s[:, :, :, None], z_stored[:, :, :, None], meta_table_ptr, SCALE_FP8,
                            INT8_ZEROS)
            g = tl.arange(0, NG)
            tl.store(zeros_ptr + mbase[:, :, None] + g[None, None, :] * stride_md, z_stored, mask=mask)
        g = tl.arange(0, NG)
        tl.store(scales_ptr + mbase[:, :, None] + g[None, None, :] * stride_md, s_stored, mask=mask)
        q = tl.where(q == q, q, 0.0).to(tl.int32)  # a NaN group stores code 0 beside its NaN scale
        pairs = tl.reshape(q, [TOKENS, HEADS_PAD, DIM // 2, 2])
        even, odd = tl.split(pairs)
        packed = (even | (odd << 4)).to(tl.uint8)
        half = tl.arange(0, DIM // 2)
        tl.store(payload_ptr + pbase[:, :, None] + half[None, None, :] * stride_pd, packed, mask=mask)


def _tables(fmt, device):
    """(finite non-negative values, full decode table, and the same two of E4M3 for fp8 scales)."""
    name = fmt.fp8 or "e4m3"
    table = fp8.decode_table(name).to(device)
    pos = table[: int(torch.isfinite(table[:128]).sum())].contiguous()
    meta = fp8.decode_table("e4m3").to(device)
    meta_pos = meta[:127].contiguous()
    return pos, table, meta_pos, meta


def _check_pools(k_pool, v_pool) -> None:
    inner = [p.inner if isinstance(p, SinkPool) else p for p in (k_pool, v_pool)]
    if all(isinstance(p, KiviPool) for p in inner):
        if inner[0].store is not inner[1].store or inner[0].layer != inner[1].layer or not inner[0].keys \
                or inner[1].keys:
            raise ValueError("KIVI pools must be (keys, values) of the same store and layer "
                             "(PagedKVCache.layer_pools)")
        require_power_of_two("head_dim (quantized Triton kernels)", inner[0].shape[-1])
        return
    k_pool, v_pool = inner
    if not isinstance(k_pool, QuantizedPool) or not isinstance(v_pool, QuantizedPool):
        raise ValueError("the quantized kernels take QuantizedPool pools (PagedKVCache.layer_pools)")
    if k_pool.fmt != v_pool.fmt or k_pool.shape != v_pool.shape:
        raise ValueError(f"K and V pools differ: {k_pool.fmt.name} "
                         f"{tuple(k_pool.shape)} vs {v_pool.fmt.name} {tuple(v_pool.shape)}")
    if k_pool.fmt.kind not in ("fp8", "int4"):
        raise ValueError(f"the quantized kernels handle fp8, int4 and kivi pools, not {k_pool.fmt.name}")
    require_power_of_two("head_dim (quantized Triton kernels)", k_pool.head_dim)
    for a, b in ((k_pool.payload, v_pool.payload), (k_pool.scales, v_pool.scales)):
        if a is not None and a.stride() != b.stride():
            raise ValueError("K and V pools must have the same strides")


def _static(pool: QuantizedPool) -> tuple[torch.Tensor, int]:
    """The static scale as a [H]-indexable tensor and its head stride (0 for one per tensor)."""
    s = pool.scale if pool.scale is not None else torch.ones((), device=pool.device)
    s = s.float().contiguous()
    return s, (1 if s.dim() else 0)


def _meta_args(pool: QuantizedPool):
    scales = pool.scales if pool.scales is not None else pool.payload  # unused pointer when absent
    zeros = pool.zeros if pool.zeros is not None else scales
    return scales, zeros, scales.stride()


def _write(x, slots, payload, scales, zeros, static, static_h, fmt, kind: str, tokens: int, tables) -> None:
    """One launch of _quant_write_kernel: x [T, H, D] encoded as `kind` (fp8, or int4 along head_dim
    with fmt's group, symmetry and scale options) into payload (and scales, zeros) at slots; tables
    from _tables, made once for K and V."""
    pos, table, meta_pos, meta = tables
    zeros = scales if zeros is None else zeros
    _quant_write_kernel[(triton.cdiv(x.shape[0], tokens),)](
        x, slots, payload, scales, zeros, static, pos, table, meta_pos, meta,
        x.shape[0], x.shape[1],
        *x.stride(), *payload.stride(), *scales.stride(), static_h,
        BLOCK_SIZE=payload.shape[1], TOKENS=tokens, HEADS_PAD=_pow2(x.shape[1]), DIM=x.shape[2],
        KIND=1 if kind == "fp8" else 2, TOP=pos.numel() - 1,
        MAX_FINITE=float(pos[-1]), RTZ=fmt.rounding == "rtz", TOKEN_SCALE=fmt.scale_rule == "token_head",
        QGROUP=fmt.group_size or 1, SYMMETRIC=fmt.symmetric, SCALE_FP8=fmt.scale_dtype == "fp8",
        INT8_ZEROS=fmt.int8_zeros, TINY=int4.SMALLEST_SCALE[fmt.scale_dtype],
    )


def triton_quant_reshape_and_cache(k, v, k_pool: QuantizedPool, v_pool: QuantizedPool, slot_mapping,
                                   tokens_per_program: int = 4, check: bool = True) -> None:
    """Quantize k, v [T, H, D] into their pools at slot_mapping [T] (-1 = skip): the bytes
    reshape_and_cache(k, v, k_pool, v_pool, slots) would store. (KIVI's groups are written by
    triton_kivi_quantize_groups; a sink's 16-bit copy by SinkStore.write.)"""
    _check_pools(k_pool, v_pool)
    if not isinstance(k_pool, QuantizedPool):
        raise ValueError("triton_quant_reshape_and_cache writes per-token formats; KIVI and sink caches are "
                         "written through attention_forward (radarlab.attention.backends)")
    num_blocks, block_size, num_kv_heads, head_dim = k_pool.shape
    if k.shape != v.shape or k.dim() != 3 or tuple(k.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(f"k and v must be [num_tokens, {num_kv_heads}, {head_dim}]; got {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if check:
        validate_slot_mapping(slot_mapping, k.shape[0], num_blocks * block_size)
    if k.shape[0] == 0:
        return
    slot_mapping = slot_mapping.contiguous()
    tables = _tables(k_pool.fmt, k.device)
    for x, pool in ((k, k_pool), (v, v_pool)):
        scales, zeros, _ = _meta_args(pool)
        _write(x, slot_mapping, pool.payload, scales, zeros, *_static(pool), pool.fmt, pool.fmt.kind,
               _pow2(tokens_per_program), tables)


@triton.jit
def _kivi_key_write_kernel(
    x_ptr, blocks_ptr, groups_ptr, payload_ptr, scales_ptr, zeros_ptr, meta_pos_ptr, meta_table_ptr,
    num_kv_heads,
    stride_pb, stride_ps, stride_ph, stride_pd, stride_mb, stride_mg, stride_mh, stride_md,
    G: tl.constexpr, HEADS_PAD: tl.constexpr, DIM: tl.constexpr,
    SCALE_FP8: tl.constexpr, INT8_ZEROS: tl.constexpr, TINY: tl.constexpr,
):
    """One KIVI key group: G tokens' keys [G, H, D] (x contiguous [n, G, H, D]) quantized per (head,
    channel) over the G tokens, asymmetric int4; codes packed along head_dim at the group's block rows,
    the D scales and zero points of each head at the group's entry."""
    i = tl.program_id(0)
    block = tl.load(blocks_ptr + i).to(tl.int64)
    group = tl.load(groups_ptr + i).to(tl.int64)
    r = tl.arange(0, G)
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, DIM)
    h_ok = h < num_kv_heads
    x = tl.load(x_ptr + ((i * G + r[:, None, None]) * num_kv_heads + h[None, :, None]) * DIM
                + d[None, None, :], mask=h_ok[None, :, None], other=0.0).to(tl.float32)
    lo = tl.min(x, axis=0)  # [HEADS, DIM]: each channel over the group's tokens
    hi = tl.max(x, axis=0)
    s_stored, s, z_stored = _asym_meta(lo, hi, meta_pos_ptr, meta_table_ptr, SCALE_FP8, INT8_ZEROS, TINY)
    q = _asym_codes(x, s[None, :, :], z_stored[None, :, :], meta_table_ptr, SCALE_FP8, INT8_ZEROS)
    moff = block * stride_mb + group * stride_mg + h[:, None] * stride_mh + d[None, :] * stride_md
    tl.store(scales_ptr + moff, s_stored, mask=h_ok[:, None])
    tl.store(zeros_ptr + moff, z_stored, mask=h_ok[:, None])
    q = tl.where(q == q, q, 0.0).to(tl.int32)
    even, odd = tl.split(tl.reshape(q, [G, HEADS_PAD, DIM // 2, 2]))
    half = tl.arange(0, DIM // 2)
    rows = group * G + r
    poff = block * stride_pb + rows[:, None, None] * stride_ps + h[None, :, None] * stride_ph
    tl.store(payload_ptr + poff + half[None, None, :] * stride_pd, (even | (odd << 4)).to(tl.uint8),
             mask=h_ok[None, :, None])


def triton_kivi_quantize_groups(ks, vs, blocks, groups, k_cache, k_scales, k_zeros, v_cache, v_scales,
                                v_zeros, fmt, block_size: int) -> None:
    """KiviStore._quantize_groups' storing half in Triton: groups ks, vs [n, g, H, D] (rows already
    filled as that method fills them) to KIVI key codes and per-token int4 value codes, at (block, group)
    of one layer's tensors: k_cache/v_cache the packed codes, k_scales/k_zeros per group and channel,
    v_scales/v_zeros per token; fmt the KIVI format (radarlab.quant.formats)."""
    n, g, H, D = ks.shape
    if n == 0:
        return
    require_power_of_two("head_dim (quantized Triton kernels)", D)
    tables = _tables(fmt, ks.device)
    _, _, meta_pos, meta = tables
    _kivi_key_write_kernel[(n,)](
        ks.float().contiguous(), blocks.contiguous(), groups.contiguous(), k_cache, k_scales, k_zeros,
        meta_pos, meta, H, *k_cache.stride(), *k_scales.stride(),
        G=g, HEADS_PAD=_pow2(H), DIM=D, SCALE_FP8=fmt.scale_dtype == "fp8", INT8_ZEROS=fmt.int8_zeros,
        TINY=int4.SMALLEST_SCALE[fmt.scale_dtype],
    )
    slots = group_slots(blocks, groups, g, block_size).reshape(-1)
    _write(vs.reshape(n * g, H, D).float(), slots.contiguous(), v_cache, v_scales, v_zeros, meta, 0, fmt,
           "int4", 4, tables)


# --------------------------------------------------------------------------------------------------
# 2. Attention that dequantizes as it loads
# --------------------------------------------------------------------------------------------------
@triton.jit
def _load_fp8(ptr, scales_ptr, static_ptr, table_ptr, block, row, kv_head, d, ok,
              stride_pb, stride_ps, stride_ph, stride_pd, stride_mb, stride_ms, stride_mh, static_h,
              TOKEN_SCALE: tl.constexpr):
    """fp32 [N, DIM] of N positions (block, row: [N]) of one KV head from FP8 codes: each byte looked up
    in the 256-entry decode table, times the head's static scale (static_ptr[kv_head * static_h]) or,
    TOKEN_SCALE, the token's own (scales_ptr, [N, B, H]); rows not ok are 0 and read nothing, so a
    position past the context never touches a block the table does not name. The default of
    triton_quant_paged_attention's fp8_load (notebook 06 has a learner write it)."""
    mask = ok[:, None]
    base = block * stride_pb + row * stride_ps + kv_head * stride_ph
    code = tl.load(ptr + base[:, None] + d[None, :] * stride_pd, mask=mask, other=0).to(tl.int32)
    x = tl.load(table_ptr + code)
    if TOKEN_SCALE:
        s = tl.load(scales_ptr + block * stride_mb + row * stride_ms + kv_head * stride_mh, mask=ok,
                    other=1.0)
        x = x * s.to(tl.float32)[:, None]
    else:
        x = x * tl.load(static_ptr + kv_head * static_h)
    return tl.where(mask, x, 0.0)


@triton.jit
def _load_dequant(ptr, scales_ptr, zeros_ptr, static_ptr, table_ptr, meta_table_ptr, block, row, kv_head, d,
                  ok,
                  stride_pb, stride_ps, stride_ph, stride_pd, stride_mb, stride_ms, stride_mh, stride_md,
                  static_h,
                  KIND: tl.constexpr, TOKEN_SCALE: tl.constexpr, QGROUP: tl.constexpr,
                  SYMMETRIC: tl.constexpr, SCALE_FP8: tl.constexpr, INT8_ZEROS: tl.constexpr,
                  FP8_LOAD: tl.constexpr):
    """fp32 [N, DIM] of N positions (block, row: [N]) of one KV head, decoded from the codes; rows not ok
    are 0. KIND 1: fp8, through FP8_LOAD (a jit function with _load_fp8's signature); 2: int4 groups
    along head_dim (a scale per token and group); 3: KIVI keys (a scale per channel, shared by the
    QGROUP tokens of a key group)."""
    if KIND == 1:
        x = FP8_LOAD(ptr, scales_ptr, static_ptr, table_ptr, block, row, kv_head, d, ok, stride_pb, stride_ps,
                     stride_ph, stride_pd, stride_mb, stride_ms, stride_mh, static_h, TOKEN_SCALE)
    else:
        base = block * stride_pb + row * stride_ps + kv_head * stride_ph
        mask = ok[:, None]
        byte = tl.load(ptr + base[:, None] + (d[None, :] // 2) * stride_pd, mask=mask, other=0).to(tl.int32)
        nib = ((byte >> ((d[None, :] % 2) * 4)) & 15).to(tl.float32)
        if KIND == 3:
            moff = ((block * stride_mb + (row // QGROUP) * stride_ms + kv_head * stride_mh)[:, None]
                    + d[None, :] * stride_md)
        else:
            moff = ((block * stride_mb + row * stride_ms + kv_head * stride_mh)[:, None]
                    + (d[None, :] // QGROUP) * stride_md)
        if SCALE_FP8:
            s = tl.load(meta_table_ptr + tl.load(scales_ptr + moff, mask=mask, other=0).to(tl.int32))
        else:
            s = tl.load(scales_ptr + moff, mask=mask, other=0.0).to(tl.float32)
        if SYMMETRIC:
            x = (nib - 8.0) * s
        elif INT8_ZEROS:
            x = (nib - tl.load(zeros_ptr + moff, mask=mask, other=0).to(tl.float32)) * s
        else:
            x = nib * s + _load_zero(tl.load(zeros_ptr + moff, mask=mask, other=0), meta_table_ptr, SCALE_FP8)
        x = tl.where(mask, x, 0.0)
    return x


@triton.jit
def _overlay(x, which, ptr, slot, kv_head, d, num_kv_heads, ROWS: tl.constexpr, DIM: tl.constexpr):
    """x [N, DIM] with each row whose `which` >= 0 replaced by the 16-bit row ptr[which, slot, kv_head]
    (ptr contiguous [*, ROWS, H, DIM]): KIVI's tails and this step's fresh groups, and the sinks."""
    has = which >= 0
    off = ((which * ROWS + slot) * num_kv_heads + kv_head) * DIM
    y = tl.load(ptr + off[:, None] + d[None, :], mask=has[:, None], other=0.0).to(tl.float32)
    return tl.where(has[:, None], y, x)


@triton.jit
def _load_kv(ptr, scales_ptr, zeros_ptr, static_ptr, tail_ptr, fresh_ptr, sink_ptr, table_ptr, meta_table_ptr,
             tail_of_ptr, fresh_of_ptr, sink_of_ptr, block, row, kv_head, d, ok, num_kv_heads,
             stride_pb, stride_ps, stride_ph, stride_pd, stride_mb, stride_ms, stride_mh, stride_md, static_h,
             DIM: tl.constexpr, KIND: tl.constexpr, TOKEN_SCALE: tl.constexpr, QGROUP: tl.constexpr,
             SYMMETRIC: tl.constexpr, SCALE_FP8: tl.constexpr, INT8_ZEROS: tl.constexpr,
             NUM_GROUPS: tl.constexpr, KIVI: tl.constexpr, SETTLE: tl.constexpr, SINK: tl.constexpr,
             FP8_LOAD: tl.constexpr):
    """K or V of N positions as stored, and (SETTLE) as they were before this step quantized them:
    (stored, fresh), each fp32 [N, DIM]. Codes first; KIVI's tails over the groups that have one;
    this step's 16-bit groups over those (fresh only); the sink over a first block's first rows."""
    x = _load_dequant(ptr, scales_ptr, zeros_ptr, static_ptr, table_ptr, meta_table_ptr, block, row, kv_head,
                      d,
                      ok, stride_pb, stride_ps, stride_ph, stride_pd, stride_mb, stride_ms, stride_mh,
                      stride_md, static_h, KIND, TOKEN_SCALE, QGROUP, SYMMETRIC, SCALE_FP8, INT8_ZEROS,
                      FP8_LOAD)
    fresh = x
    if KIVI:
        entry = block * NUM_GROUPS + row // QGROUP
        x = _overlay(x, tl.load(tail_of_ptr + entry, mask=ok, other=-1), tail_ptr, row % QGROUP, kv_head, d,
                     num_kv_heads, QGROUP, DIM)
        fresh = x
        if SETTLE:
            fresh = _overlay(x, tl.load(fresh_of_ptr + entry, mask=ok, other=-1), fresh_ptr, row % QGROUP,
                             kv_head, d, num_kv_heads, QGROUP, DIM)
    if SINK > 0:
        which = tl.load(sink_of_ptr + block, mask=ok & (row < SINK), other=-1)
        x = _overlay(x, which, sink_ptr, row, kv_head, d, num_kv_heads, SINK, DIM)
        fresh = _overlay(fresh, which, sink_ptr, row, kv_head, d, num_kv_heads, SINK, DIM)
    return x, fresh


@triton.jit
def _quant_attention_kernel(
    q_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, scale,
    k_ptr, k_scales_ptr, k_zeros_ptr, k_static_ptr, k_tail_ptr, k_fresh_ptr, k_sink_ptr,
    v_ptr, v_scales_ptr, v_zeros_ptr, v_static_ptr, v_tail_ptr, v_fresh_ptr, v_sink_ptr,
    table_ptr, meta_table_ptr, tail_of_ptr, fresh_of_ptr, sink_of_ptr, num_kv_heads,
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
    stride_pb, stride_ps, stride_ph, stride_pd,
    stride_kmb, stride_kms, stride_kmh, stride_kmd, stride_vmb, stride_vms, stride_vmh, stride_vmd, static_h,
    stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    K_KIND: tl.constexpr, V_KIND: tl.constexpr, TOKEN_SCALE: tl.constexpr, QGROUP: tl.constexpr,
    SYMMETRIC: tl.constexpr, SCALE_FP8: tl.constexpr, INT8_ZEROS: tl.constexpr,
    KIVI: tl.constexpr, SETTLE: tl.constexpr, RESIDUAL: tl.constexpr, SINK: tl.constexpr,
    FP8_LOAD: tl.constexpr,
):
    """Causal attention of a tile of one sequence's new queries over its paged, quantized context.

    triton_paged.py's prefill kernel with one change: K and V tiles come through _load_kv (FP8 codes
    through FP8_LOAD, a jit function passed as a compile-time argument). One
    program per (sequence, KV head, tile of BLOCK_Q new tokens); rows are (token, head of the GQA
    group); online softmax; scores and p.v in fp32 (broadcast and sum, so decode's single row needs
    no 16-row tl.dot). Decode is the case query_len = 1.

    SETTLE (KIVI): the query at position t reads a key or value as stored only below
    quantized_length(t + 1), and as it was before this step quantized it beyond (the rule of
    radarlab.attention.reference.attention_settled), so a prefill reads what decoding would have read.
    """
    seq, kv_head, q_start, query_len, token, g, q_pos, kv_end = prefill_tile(
        query_start_loc_ptr, seq_lens_ptr, BLOCK_Q, BLOCK_M, GROUP_PAD)
    if tl.program_id(2) * BLOCK_Q >= query_len:
        return
    settled = tl.maximum(q_pos + 1 - RESIDUAL, 0) // QGROUP * QGROUP  # kivi.quantized_length(t + 1)
    d = tl.arange(0, DIM)
    row_ok = (token < query_len) & (g < GROUP)
    q_rows = (q_start + token) * stride_qt + (kv_head * GROUP + g) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :] * stride_qd, mask=row_ok[:, None],
                other=0.0).to(tl.float32)
    q = q * scale

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    for start in range(0, kv_end, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        pos_ok = pos < kv_end
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        row = pos % BLOCK_SIZE
        k, k_fresh = _load_kv(k_ptr, k_scales_ptr, k_zeros_ptr, k_static_ptr, k_tail_ptr, k_fresh_ptr,
                              k_sink_ptr,
                              table_ptr, meta_table_ptr, tail_of_ptr, fresh_of_ptr, sink_of_ptr, block, row,
                              kv_head,
                              d, pos_ok, num_kv_heads, stride_pb, stride_ps, stride_ph, stride_pd, stride_kmb,
                              stride_kms, stride_kmh, stride_kmd, static_h, DIM, K_KIND, TOKEN_SCALE, QGROUP,
                              SYMMETRIC, SCALE_FP8, INT8_ZEROS, BLOCK_SIZE // QGROUP, KIVI, SETTLE, SINK,
                              FP8_LOAD)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [BLOCK_M, TILE_N]
        if SETTLE:
            stored = pos[None, :] < settled[:, None]
            s = tl.where(stored, s, tl.sum(q[:, None, :] * k_fresh[None, :, :], axis=2))
        visible = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padded rows see nothing
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        v, v_fresh = _load_kv(v_ptr, v_scales_ptr, v_zeros_ptr, v_static_ptr, v_tail_ptr, v_fresh_ptr,
                              v_sink_ptr,
                              table_ptr, meta_table_ptr, tail_of_ptr, fresh_of_ptr, sink_of_ptr, block, row,
                              kv_head,
                              d, pos_ok, num_kv_heads, stride_pb, stride_ps, stride_ph, stride_pd, stride_vmb,
                              stride_vms, stride_vmh, stride_vmd, static_h, DIM, V_KIND, TOKEN_SCALE, QGROUP,
                              SYMMETRIC, SCALE_FP8, INT8_ZEROS, BLOCK_SIZE // QGROUP, KIVI, SETTLE, SINK,
                              FP8_LOAD)
        if SETTLE:
            pv = tl.sum(tl.where(stored, p, 0.0)[:, :, None] * v[None, :, :], axis=1) \
                + tl.sum(tl.where(stored, 0.0, p)[:, :, None] * v_fresh[None, :, :], axis=1)
        else:
            pv = tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new

    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    o_rows = (q_start + token) * stride_ot + (kv_head * GROUP + g) * stride_oh
    tl.store(out_ptr + o_rows[:, None] + d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def _sides(k_pool, v_pool, device):
    """Kernel arguments of what attention reads: per side (K, V) its codes, scales, zero points, static
    scale, 16-bit tails, fresh groups and sinks; shared, the tail, fresh and sink maps and the format's
    constants. Absent tensors are stood in for by the payload (never read: their constexpr is off)."""
    sink = (k_pool.store, k_pool.layer) if isinstance(k_pool, SinkPool) else None
    k_pool, v_pool = (p.inner if isinstance(p, SinkPool) else p for p in (k_pool, v_pool))
    sides = []
    if isinstance(k_pool, KiviPool):
        st, L = k_pool.store, k_pool.layer
        fmt = st.fmt
        settle = k_pool.fresh and v_pool.fresh
        plan = st.plan or {}
        tail_of = plan.get("tail_of", st.tail_of).to(device)  # the plan's copy is already on the device
        fresh_of = plan["fresh_of"].to(device) if settle else tail_of
        for keys, payload, scales, zeros, tail in ((True, st.k[L], st.k_scales[L], st.k_zeros[L],
                                                    st.k_tail[L]),
                                                   (False, st.v[L], st.v_scales[L], st.v_zeros[L],
                                                    st.v_tail[L])):
            fresh = st.fresh[1 if keys else 2] if settle else tail
            sides.append(dict(payload=payload, scales=scales, zeros=zeros, static=payload,
                              tail=tail.contiguous(), fresh=fresh.contiguous(), kind=3 if keys else 2))
        shared = dict(fmt=fmt, static_h=0, tail_of=tail_of.contiguous(), fresh_of=fresh_of.contiguous(),
                      kivi=True, settle=settle, residual=fmt.residual)
    else:
        fmt = k_pool.fmt
        for pool in (k_pool, v_pool):
            scales, zeros, _ = _meta_args(pool)
            static, static_h = _static(pool)
            sides.append(dict(payload=pool.payload, scales=scales, zeros=zeros, static=static,
                              tail=pool.payload, fresh=pool.payload, kind=1 if fmt.kind == "fp8" else 2))
        shared = dict(fmt=fmt, static_h=static_h, tail_of=sides[0]["payload"], fresh_of=sides[0]["payload"],
                      kivi=False, settle=False, residual=0)
    for side, keys in zip(sides, (True, False)):
        side["sink"] = (sink[0].k if keys else sink[0].v)[sink[1]].contiguous() if sink else side["payload"]
    shared["sink_of"] = sink[0].sink_of.to(device) if sink else sides[0]["payload"]
    shared["sink"] = sink[0].sink if sink else 0
    return sides, shared


def triton_quant_paged_attention(q, k_pool, v_pool, block_tables, seq_lens, query_start_loc, scale, out=None,
                                 block_q: int = 4, tile_n: int = 16, check: bool = True,
                                 fp8_load=None) -> torch.Tensor:
    """Packed queries q [T, H, D] over quantized pools, causal: prefill, chunked prefill and decode rows
    in one launch. The pools are PagedKVCache.layer_pools: QuantizedPool (fp8, int4), KiviPool (with
    fresh=True, each query reads what it read as the newest token), either one wrapped in a SinkPool.
    The torch reference is paged_attention_torch over the same pools (with settling, for KIVI).
    fp8_load: a jit function with _load_fp8's signature that loads FP8 tiles in its place (notebook
    06's exercise); None: _load_fp8."""
    _check_pools(k_pool, v_pool)
    validate_pool(k_pool, v_pool)
    num_blocks, block_size, num_kv_heads, head_dim = k_pool.shape
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(f"q must be [num_tokens, a multiple of {num_kv_heads} heads, "
                         f"{head_dim}], got {tuple(q.shape)}")
    if query_start_loc.dim() != 1 or query_start_loc.numel() != seq_lens.numel() + 1:
        raise ValueError(f"query_start_loc must have len(seq_lens)+1 = {seq_lens.numel() + 1} entries")
    if check:
        validate_block_tables(block_tables, seq_lens, num_blocks, block_size)
    out = torch.empty_like(q) if out is None else out
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    if q.shape[0] == 0 or seq_lens.numel() == 0:
        return out
    (ks, vs), shared = _sides(k_pool, v_pool, q.device)
    fmt = shared["fmt"]
    _, table, _, meta = _tables(fmt, q.device)
    group = q.shape[1] // num_kv_heads
    group_pad = _pow2(group)
    block_q = _pow2(block_q)
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    grid = (seq_lens.numel(), num_kv_heads, triton.cdiv(int(query_lens.max()), block_q))
    _quant_attention_kernel[grid](
        q, out, block_tables, seq_lens.contiguous(), query_start_loc.contiguous(), float(scale),
        *(ks[n] for n in ("payload", "scales", "zeros", "static", "tail", "fresh", "sink")),
        *(vs[n] for n in ("payload", "scales", "zeros", "static", "tail", "fresh", "sink")),
        table, meta, shared["tail_of"], shared["fresh_of"], shared["sink_of"], num_kv_heads,
        *q.stride(), *out.stride(), *ks["payload"].stride(), *ks["scales"].stride(), *vs["scales"].stride(),
        shared["static_h"], block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_Q=block_q,
        BLOCK_M=block_q * group_pad, TILE_N=_pow2(tile_n),
        K_KIND=ks["kind"], V_KIND=vs["kind"], TOKEN_SCALE=fmt.scale_rule == "token_head",
        QGROUP=fmt.group_size or 1, SYMMETRIC=fmt.symmetric, SCALE_FP8=fmt.scale_dtype == "fp8",
        INT8_ZEROS=fmt.int8_zeros, KIVI=shared["kivi"], SETTLE=shared["settle"], RESIDUAL=shared["residual"],
        SINK=shared["sink"], FP8_LOAD=_load_fp8 if fp8_load is None else fp8_load,
    )
    return out
