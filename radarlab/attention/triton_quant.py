"""Triton kernels for quantized paged caches: the write that quantizes, and decode / prefill attention
that dequantizes each tile of K and V as it loads it. The whole pool is never decoded.

The pools are QuantizedPool views (radarlab.quant.kv_codec): a uint8 payload [N, B, H, Dp] and, where
the format stores them, block-shaped scales and zero points [N, B, H, S]. Three kinds of load:

- fp8 (KIND 1): a byte is a code; its value comes from the 256-entry decode table, times the static
  scale of the head (k_scale / v_scale) or the token's own scale (fp8_per_token_head);
- int4 (KIND 2): element d lives in byte d // 2, low nibble for even d; times its group's scale
  (fp16, or an E4M3 code looked up in the same kind of table), plus the zero point when asymmetric;
- 16-bit pools go through triton_paged.py's kernels, which need none of this.

The write encodes exactly as radarlab.quant does in torch, so the two paths store the same bytes:
FP8 by a binary search over the format's 127 (or 124) finite non-negative values, then round to
nearest even or toward zero; INT4 by group amax (or min and max), the scale stored in fp16 or FP8
(rounded up, zero points down) before the values are divided by it, half-to-even rounding, two codes
packed a byte. Everything is fp32 inside. The torch references are reshape_and_cache with QuantizedPool
pools and paged_attention_torch over them; tests/test_quant_triton.py runs both under the interpreter.
Head dims must be powers of two here (no padded lanes inside a group).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from radarlab.attention.layout import validate_block_tables, validate_pool, validate_slot_mapping
from radarlab.quant import fp8
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


# --------------------------------------------------------------------------------------------------
# 1. The quantizing write
# --------------------------------------------------------------------------------------------------
@triton.jit
def _quant_write_kernel(
    x_ptr, slot_ptr, payload_ptr, scales_ptr, zeros_ptr, static_ptr, pos_ptr, table_ptr, meta_pos_ptr, meta_table_ptr,
    num_tokens, num_kv_heads,
    stride_xt, stride_xh, stride_xd,
    stride_pb, stride_ps, stride_ph, stride_pd,
    stride_mb, stride_ms, stride_mh, stride_md,
    static_h,
    BLOCK_SIZE: tl.constexpr, TOKENS: tl.constexpr, HEADS_PAD: tl.constexpr, DIM: tl.constexpr,
    KIND: tl.constexpr, TOP: tl.constexpr, MAX_FINITE: tl.constexpr, RTZ: tl.constexpr, TOKEN_SCALE: tl.constexpr,
    QGROUP: tl.constexpr, SYMMETRIC: tl.constexpr, SCALE_FP8: tl.constexpr, TINY: tl.constexpr,
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
    x = tl.load(x_ptr + tokens[:, None, None] * stride_xt + h[None, :, None] * stride_xh + d[None, None, :] * stride_xd,
                mask=mask, other=0.0).to(tl.float32)
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
        tl.store(payload_ptr + pbase[:, :, None] + d[None, None, :] * stride_pd, codes.to(tl.uint8), mask=mask)
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
            z_stored, z = _store_meta(lo, meta_pos_ptr, meta_table_ptr, SCALE_FP8, False)
            span = tl.div_rn(hi - z, tl.full(hi.shape, 15.0, tl.float32))
            s_stored, s = _store_meta(tl.maximum(span, TINY), meta_pos_ptr, meta_table_ptr, SCALE_FP8, True)
            q = tl.minimum(tl.maximum(_round_half_even(tl.div_rn(xg - z[:, :, :, None], s[:, :, :, None])), 0.0), 15.0)
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
    if not isinstance(k_pool, QuantizedPool) or not isinstance(v_pool, QuantizedPool):
        raise ValueError("the quantized kernels take QuantizedPool pools (PagedKVCache.layer_pools)")
    if k_pool.fmt != v_pool.fmt or k_pool.shape != v_pool.shape:
        raise ValueError(f"K and V pools differ: {k_pool.fmt.name} {tuple(k_pool.shape)} vs {v_pool.fmt.name} "
                         f"{tuple(v_pool.shape)}")
    if k_pool.fmt.kind not in ("fp8", "int4"):
        raise ValueError(f"the quantized kernels handle fp8 and int4 pools, not {k_pool.fmt.name}")
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


def triton_quant_reshape_and_cache(k, v, k_pool: QuantizedPool, v_pool: QuantizedPool, slot_mapping,
                                   tokens_per_program: int = 4, check: bool = True) -> None:
    """Quantize k, v [T, H, D] into their pools at slot_mapping [T] (-1 = skip): the bytes
    reshape_and_cache(k, v, k_pool, v_pool, slots) would store."""
    _check_pools(k_pool, v_pool)
    num_blocks, block_size, num_kv_heads, head_dim = k_pool.shape
    if k.shape != v.shape or k.dim() != 3 or tuple(k.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(f"k and v must be [num_tokens, {num_kv_heads}, {head_dim}]; got {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if check:
        validate_slot_mapping(slot_mapping, k.shape[0], num_blocks * block_size)
    if k.shape[0] == 0:
        return
    fmt = k_pool.fmt
    pos, table, meta_pos, meta = _tables(fmt, k.device)
    slot_mapping = slot_mapping.contiguous()
    tokens = _pow2(tokens_per_program)
    for x, pool in ((k, k_pool), (v, v_pool)):
        static, static_h = _static(pool)
        scales, zeros, mstride = _meta_args(pool)
        _quant_write_kernel[(triton.cdiv(x.shape[0], tokens),)](
            x, slot_mapping, pool.payload, scales, zeros, static, pos, table, meta_pos, meta,
            x.shape[0], num_kv_heads,
            *x.stride(), *pool.payload.stride(), *mstride, static_h,
            BLOCK_SIZE=block_size, TOKENS=tokens, HEADS_PAD=_pow2(num_kv_heads), DIM=head_dim,
            KIND=1 if fmt.kind == "fp8" else 2, TOP=pos.numel() - 1,
            MAX_FINITE=float(pos[-1]), RTZ=fmt.rounding == "rtz", TOKEN_SCALE=fmt.scale_rule == "token_head",
            QGROUP=fmt.group_size or 1, SYMMETRIC=fmt.symmetric, SCALE_FP8=fmt.scale_dtype == "fp8",
            TINY=2.0**-24 if fmt.scale_dtype == "fp16" else 2.0**-9,
        )


# --------------------------------------------------------------------------------------------------
# 2. Attention that dequantizes as it loads
# --------------------------------------------------------------------------------------------------
@triton.jit
def _load_dequant(ptr, scales_ptr, zeros_ptr, static_ptr, table_ptr, meta_table_ptr, block, row, kv_head, d, ok,
                  stride_pb, stride_ps, stride_ph, stride_pd, stride_mb, stride_ms, stride_mh, stride_md, static_h,
                  KIND: tl.constexpr, TOKEN_SCALE: tl.constexpr, QGROUP: tl.constexpr, SYMMETRIC: tl.constexpr,
                  SCALE_FP8: tl.constexpr):
    """fp32 [N, DIM] of N positions (block, row: [N]) of one KV head; rows not ok are 0."""
    base = block * stride_pb + row * stride_ps + kv_head * stride_ph
    mbase = block * stride_mb + row * stride_ms + kv_head * stride_mh
    mask = ok[:, None]
    if KIND == 1:
        code = tl.load(ptr + base[:, None] + d[None, :] * stride_pd, mask=mask, other=0).to(tl.int32)
        x = tl.load(table_ptr + code)
        if TOKEN_SCALE:
            x = x * tl.load(scales_ptr + mbase, mask=ok, other=1.0).to(tl.float32)[:, None]
        else:
            x = x * tl.load(static_ptr + kv_head * static_h)
    else:
        byte = tl.load(ptr + base[:, None] + (d[None, :] // 2) * stride_pd, mask=mask, other=0).to(tl.int32)
        nib = ((byte >> ((d[None, :] % 2) * 4)) & 15).to(tl.float32)
        moff = mbase[:, None] + (d[None, :] // QGROUP) * stride_md
        if SCALE_FP8:
            s = tl.load(meta_table_ptr + tl.load(scales_ptr + moff, mask=mask, other=0).to(tl.int32))
        else:
            s = tl.load(scales_ptr + moff, mask=mask, other=0.0).to(tl.float32)
        if SYMMETRIC:
            x = (nib - 8.0) * s
        else:
            if SCALE_FP8:
                z = tl.load(meta_table_ptr + tl.load(zeros_ptr + moff, mask=mask, other=0).to(tl.int32))
            else:
                z = tl.load(zeros_ptr + moff, mask=mask, other=0.0).to(tl.float32)
            x = nib * s + z
    return tl.where(mask, x, 0.0)


@triton.jit
def _quant_attention_kernel(
    q_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, scale,
    k_ptr, k_scales_ptr, k_zeros_ptr, k_static_ptr, v_ptr, v_scales_ptr, v_zeros_ptr, v_static_ptr,
    table_ptr, meta_table_ptr,
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
    stride_pb, stride_ps, stride_ph, stride_pd, stride_mb, stride_ms, stride_mh, stride_md, static_h,
    stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
    KIND: tl.constexpr, TOKEN_SCALE: tl.constexpr, QGROUP: tl.constexpr, SYMMETRIC: tl.constexpr,
    SCALE_FP8: tl.constexpr,
):
    """Causal attention of a tile of one sequence's new queries over its paged, quantized context.

    triton_paged.py's prefill kernel with one change: K and V tiles come through _load_dequant. One
    program per (sequence, KV head, tile of BLOCK_Q new tokens); rows are (token, head of the GQA
    group); online softmax; scores and p.v in fp32 (broadcast and sum, so decode's single row needs
    no 16-row tl.dot). Decode is the case query_len = 1.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    query_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64) - q_start
    if q_tile * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    context = seq_len - query_len

    r = tl.arange(0, BLOCK_M)
    token = q_tile * BLOCK_Q + r // GROUP_PAD
    g = r % GROUP_PAD
    q_pos = context + token
    d = tl.arange(0, DIM)
    row_ok = (token < query_len) & (g < GROUP)
    q_rows = (q_start + token) * stride_qt + (kv_head * GROUP + g) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :] * stride_qd, mask=row_ok[:, None], other=0.0).to(tl.float32)
    q = q * scale

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM], tl.float32)
    kv_end = tl.minimum(seq_len, context + (q_tile + 1) * BLOCK_Q)
    table = block_tables_ptr + seq * stride_bt
    for start in range(0, kv_end, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        pos_ok = pos < kv_end
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        row = pos % BLOCK_SIZE
        k = _load_dequant(k_ptr, k_scales_ptr, k_zeros_ptr, k_static_ptr, table_ptr, meta_table_ptr, block, row,
                          kv_head, d, pos_ok, stride_pb, stride_ps, stride_ph, stride_pd, stride_mb, stride_ms,
                          stride_mh, stride_md, static_h, KIND, TOKEN_SCALE, QGROUP, SYMMETRIC, SCALE_FP8)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [BLOCK_M, TILE_N]
        visible = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # padded rows see nothing
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        v = _load_dequant(v_ptr, v_scales_ptr, v_zeros_ptr, v_static_ptr, table_ptr, meta_table_ptr, block, row,
                          kv_head, d, pos_ok, stride_pb, stride_ps, stride_ph, stride_pd, stride_mb, stride_ms,
                          stride_mh, stride_md, static_h, KIND, TOKEN_SCALE, QGROUP, SYMMETRIC, SCALE_FP8)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new

    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    o_rows = (q_start + token) * stride_ot + (kv_head * GROUP + g) * stride_oh
    tl.store(out_ptr + o_rows[:, None] + d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])


def triton_quant_paged_attention(q, k_pool: QuantizedPool, v_pool: QuantizedPool, block_tables, seq_lens,
                                 query_start_loc, scale, out=None, block_q: int = 4, tile_n: int = 16,
                                 check: bool = True) -> torch.Tensor:
    """Packed queries q [T, H, D] over quantized pools, causal: prefill, chunked prefill and decode rows
    in one launch. The torch reference is paged_attention_torch(q, k_pool, v_pool, ...)."""
    _check_pools(k_pool, v_pool)
    validate_pool(k_pool, v_pool)
    num_blocks, block_size, num_kv_heads, head_dim = k_pool.shape
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(f"q must be [num_tokens, a multiple of {num_kv_heads} heads, {head_dim}], got {tuple(q.shape)}")
    if query_start_loc.dim() != 1 or query_start_loc.numel() != seq_lens.numel() + 1:
        raise ValueError(f"query_start_loc must have len(seq_lens)+1 = {seq_lens.numel() + 1} entries")
    if check:
        validate_block_tables(block_tables, seq_lens, num_blocks, block_size)
    out = torch.empty_like(q) if out is None else out
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    if q.shape[0] == 0 or seq_lens.numel() == 0:
        return out
    fmt = k_pool.fmt
    _, table, _, meta = _tables(fmt, q.device)
    group = q.shape[1] // num_kv_heads
    group_pad = _pow2(group)
    block_q = _pow2(block_q)
    k_static, static_h = _static(k_pool)
    v_static, _ = _static(v_pool)
    k_scales, k_zeros, mstride = _meta_args(k_pool)
    v_scales, v_zeros, _ = _meta_args(v_pool)
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    grid = (seq_lens.numel(), num_kv_heads, triton.cdiv(int(query_lens.max()), block_q))
    _quant_attention_kernel[grid](
        q, out, block_tables, seq_lens.contiguous(), query_start_loc.contiguous(), float(scale),
        k_pool.payload, k_scales, k_zeros, k_static, v_pool.payload, v_scales, v_zeros, v_static, table, meta,
        *q.stride(), *out.stride(), *k_pool.payload.stride(), *mstride, static_h, block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_Q=block_q,
        BLOCK_M=block_q * group_pad, TILE_N=_pow2(tile_n),
        KIND=1 if fmt.kind == "fp8" else 2, TOKEN_SCALE=fmt.scale_rule == "token_head",
        QGROUP=fmt.group_size or 1, SYMMETRIC=fmt.symmetric, SCALE_FP8=fmt.scale_dtype == "fp8",
    )
    return out
