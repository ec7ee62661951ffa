"""Triton kernels for the paged KV cache: the KV write, decode attention (whole-context and split-KV)
and prefill attention.

All three read or write the pool of one layer, [num_blocks, block_size, num_kv_heads, head_dim],
through vLLM's two indirections: a slot mapping (where each new token's K/V goes) and block tables
(which physical blocks hold each sequence's context). Nothing is gathered into a contiguous copy.

They run compiled on CUDA and under TRITON_INTERPRET=1 on CPU (import radarlab first). Everything is
computed in fp32 whatever the cache dtype, because the interpreter has no bf16 tl.dot, and fp32 keeps
the kernels within ~1e-6 of attention_reference. Two rules of Triton shape the code:
- tl.arange sizes must be powers of two, so head_dim, the GQA group and the head count are padded up
  to one (the *_PAD sizes) and the padding is masked off;
- compiled tl.dot needs every dimension >= 16, so the prefill kernel pads its tiles to 16 and the
  decode kernel (one query row per head) uses broadcast-multiply-and-sum instead of tl.dot.

Each wrapper checks its slot mapping or block tables first (a ValueError naming the bad entry)
unless check=False, which benchmarks use to keep host syncs out of the timing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from radarlab.attention.layout import (
    validate_block_tables,
    validate_partition_size,
    validate_pool,
    validate_slot_mapping,
)


def _pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, triton.next_power_of_2(int(n)))


# --------------------------------------------------------------------------------------------------
# 1. The KV write (vLLM's reshape_and_cache)
# --------------------------------------------------------------------------------------------------
@triton.jit
def _reshape_and_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    num_tokens,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, TOKENS: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
):
    """Scatter the K and V of TOKENS new tokens into the pool.

    One program per TOKENS consecutive tokens (one would do; a few per program means fewer
    launches, which is what the interpreter pays for). Each token's slot says where it goes:
    block slot // BLOCK_SIZE, row slot % BLOCK_SIZE. A slot of -1 marks padding and masks that
    token's lanes off, as does a token index past the end. A token's [num_kv_heads, head_dim]
    values move as one piece; the padded lanes of HEADS_PAD x DIM_PAD are masked off too.
    """
    tokens = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    slots = tl.load(slot_mapping_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    blocks = slots // BLOCK_SIZE
    rows = slots % BLOCK_SIZE

    t = tokens[:, None, None]
    h = tl.arange(0, HEADS_PAD)[None, :, None]
    d = tl.arange(0, DIM_PAD)[None, None, :]
    mask = (slots >= 0)[:, None, None] & (h < num_kv_heads) & (d < head_dim)  # [TOKENS, HEADS, DIM]

    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    dst = (blocks * stride_cb + rows * stride_cs)[:, None, None] + h * stride_ch + d * stride_cd
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def triton_reshape_and_cache(k, v, k_cache, v_cache, slot_mapping, tokens_per_program: int = 16,
                             check: bool = True, kv_cache_dtype="auto", k_scale=1.0, v_scale=1.0) -> None:
    """Write k, v [T, kv_heads, D] into the pools at slot_mapping [T] (-1 = skip), in place.

    kv_cache_dtype, k_scale and v_scale as in vLLM's op: an fp8 cache (uint8 pools) stores
    encode(k / k_scale), written by triton_quant's quantizing kernel."""
    from radarlab.quant.formats import kv_format

    fmt = kv_format(kv_cache_dtype)
    if fmt.is_quantized:
        from radarlab.attention.triton_quant import triton_quant_reshape_and_cache
        from radarlab.quant.kv_codec import QuantizedPool

        pools = (QuantizedPool(fmt, k_cache, scale=k_scale, head_dim=k.shape[-1]),
                 QuantizedPool(fmt, v_cache, scale=v_scale, head_dim=v.shape[-1]))
        return triton_quant_reshape_and_cache(k, v, *pools, slot_mapping, check=check)
    validate_pool(k_cache, v_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if k.shape != v.shape or k.dim() != 3 or tuple(k.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(f"k and v must be [num_tokens, {num_kv_heads}, {head_dim}] to match the pool; got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same strides")
    if check:
        validate_slot_mapping(slot_mapping, k.shape[0], num_blocks * block_size)
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    slot_mapping = slot_mapping.contiguous()
    tokens = _pow2(tokens_per_program)
    _reshape_and_cache_kernel[(triton.cdiv(num_tokens, tokens),)](
        k, v, k_cache, v_cache, slot_mapping,
        num_tokens,
        *k.stride(), *v.stride(), *k_cache.stride(),
        num_kv_heads, head_dim,
        BLOCK_SIZE=block_size, TOKENS=tokens, HEADS_PAD=_pow2(num_kv_heads), DIM_PAD=_pow2(head_dim),
    )


# --------------------------------------------------------------------------------------------------
# 2. Decode: one new query per sequence
# --------------------------------------------------------------------------------------------------
@triton.jit
def _attend_positions(q, m, l, acc, k_cache_ptr, v_cache_ptr, table, first, last, head_offset, dim_offsets,
                      dim_ok, stride_cb, stride_cs, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):
    """Fold positions first .. last - 1 of one sequence into the running (m, l, acc) of one GQA group's
    queries, TILE_N positions at a time, reading each position's K and V where its block lies: the loop
    the decode kernel runs over a whole context and the split-KV kernel over one partition."""
    for start in range(first, last, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        pos_ok = pos < last
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        rows = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + head_offset  # int64: pools can be large
        kv_offsets = rows[:, None] + dim_offsets
        kv_mask = pos_ok[:, None] & dim_ok[None, :]

        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)  # [TILE_N, D]
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [GROUP, TILE_N]
        s = tl.where(pos_ok[None, :], s, float("-inf"))

        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)  # [TILE_N, D]
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new
    return m, l, acc


@triton.jit
def _attend_group(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, first, last, scale,
                  stride_qt, stride_qh, stride_qd, stride_cb, stride_cs, stride_ch, stride_cd, stride_bt,
                  head_dim,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):
    """(m, l, acc) of one sequence's GQA group (the query heads that share kv_head) over positions
    first .. last - 1: its query loaded once and pre-scaled, then _attend_positions from an empty state."""
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + g
    dim_ok = d < head_dim
    q_mask = (g < GROUP)[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=q_mask, other=0.0).to(tl.float32)
    q = q * scale
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    dim_offsets = d[None, :] * stride_cd  # loop-invariant address parts are computed once
    return _attend_positions(q, m, l, acc, k_cache_ptr, v_cache_ptr, table, first, last, kv_head * stride_ch,
                             dim_offsets, dim_ok, stride_cb, stride_cs, BLOCK_SIZE, TILE_N)


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr,
    scale,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_bt,
    head_dim,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
):
    """Attention of one sequence's single query over its whole context, for one KV head.

    One program per (sequence, KV head). With GQA, GROUP query heads share that KV head, so the
    program takes all of them at once: a [GROUP, D] tile of queries. Every K/V byte is then read
    from memory once per group instead of once per query head, and decode is bound by exactly
    those reads.

    The context is walked in tiles of TILE_N positions, for as many tiles as seq_len needs (a
    runtime count: sequences in a batch differ). For each position the block table names the
    physical block (position // BLOCK_SIZE picks the entry) and the row inside it
    (position % BLOCK_SIZE); a tile may span several small blocks or part of a large one.
    Scores are q . k summed over D (no tl.dot: a GROUP x TILE_N product is below tl.dot's 16 x 16
    minimum). Online softmax keeps a running max m, a running sum l and an unnormalised output
    acc per query head; each new tile rescales them by exp(m_old - m_new). One division at the
    end gives softmax(q k^T * scale) v.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + g
    q_mask = (g < GROUP)[:, None] & (d < head_dim)[None, :]
    m, l, acc = _attend_group(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, 0, seq_len,
                              scale,
                              stride_qt, stride_qh, stride_qd, stride_cb, stride_cs, stride_ch, stride_cd,
                              stride_bt, head_dim, GROUP, GROUP_PAD, DIM_PAD, BLOCK_SIZE, TILE_N)

    out = acc / l[:, None]
    tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def triton_paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, out=None,
                        tile_n: int = 32, check: bool = True, kernel=None) -> torch.Tensor:
    """q [B, H, D], one query per sequence (its newest token, already written to the cache).
    Returns [B, H, D]. seq_lens[b] >= 1 is the context length including that token. kernel: a jit
    function with _paged_decode_kernel's signature to launch instead (notebook 04's exercise)."""
    validate_pool(k_cache, v_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_seqs, num_heads = _check_query(q, num_kv_heads, head_dim)
    if check:
        _check_decode(block_tables, seq_lens, num_seqs, num_blocks, block_size)
    block_tables, seq_lens = _rows_contiguous(block_tables), seq_lens.contiguous()
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    kernel = _paged_decode_kernel if kernel is None else kernel
    kernel[(num_seqs, num_kv_heads)](
        q, k_cache, v_cache, out, block_tables, seq_lens,
        float(scale),
        *q.stride(), *out.stride(), *k_cache.stride(), block_tables.stride(0),
        head_dim,
        GROUP=group, GROUP_PAD=_pow2(group), DIM_PAD=_pow2(head_dim),
        BLOCK_SIZE=block_size, TILE_N=_pow2(tile_n),
    )
    return out


# --------------------------------------------------------------------------------------------------
# 2b. Split-KV decode (flash-decoding, vLLM's paged_attention_v2): partitions, then a combine
# --------------------------------------------------------------------------------------------------
@triton.jit
def _paged_decode_partition_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, part_out_ptr, part_max_ptr, part_sum_ptr, block_tables_ptr, seq_lens_ptr,
    scale,
    stride_qt, stride_qh, stride_qd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_bt,
    stride_pot, stride_poh, stride_pop, stride_pod,
    stride_pmt, stride_pmh, stride_pmp,
    head_dim,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, PARTITION_SIZE: tl.constexpr, TILE_N: tl.constexpr,
):
    """Phase 1: attention of one sequence's query over one partition of its context, for one KV head.

    One program per (sequence, KV head, partition), so a few long sequences still launch many
    programs. Partition `part` covers positions [part * PARTITION_SIZE, (part + 1) * PARTITION_SIZE)
    clipped to seq_len; the grid is sized for the longest sequence, so a shorter one's programs past
    its end return at once and write nothing (the combine never reads those slots).

    Inside the partition it is the decode kernel unchanged: the GROUP query heads of the KV head
    together, tiles of TILE_N positions through the block table, online softmax. But it does not
    finish the softmax over the whole context, which it has not seen. It stores the partition's own
    result, acc / l, with the running max m and sum l that say how much that result weighs.
    """
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    first = part * PARTITION_SIZE
    if first >= seq_len:
        return
    last = tl.minimum(seq_len, first + PARTITION_SIZE)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + g
    q_mask = (g < GROUP)[:, None] & (d < head_dim)[None, :]
    m, l, acc = _attend_group(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, first, last,
                              scale,
                              stride_qt, stride_qh, stride_qd, stride_cb, stride_cs, stride_ch, stride_cd,
                              stride_bt, head_dim, GROUP, GROUP_PAD, DIM_PAD, BLOCK_SIZE, TILE_N)

    stats = seq * stride_pmt + heads * stride_pmh + part * stride_pmp
    tl.store(part_max_ptr + stats, m, mask=g < GROUP)
    tl.store(part_sum_ptr + stats, l, mask=g < GROUP)
    out_rows = seq * stride_pot + heads * stride_poh + part * stride_pop
    tl.store(part_out_ptr + out_rows[:, None] + d[None, :] * stride_pod, acc / l[:, None], mask=q_mask)


@triton.jit
def _combine_partitions_kernel(
    part_out_ptr, part_max_ptr, part_sum_ptr, out_ptr, seq_lens_ptr,
    stride_pot, stride_poh, stride_pop, stride_pod,
    stride_pmt, stride_pmh, stride_pmp,
    stride_ot, stride_oh, stride_od,
    head_dim,
    DIM_PAD: tl.constexpr, PARTITION_SIZE: tl.constexpr, PARTS_TILE: tl.constexpr,
):
    """Phase 2: merge one (sequence, query head)'s partitions into its attention output.

    Partition i left out_i (normalised by its own sum l_i, under its own max m_i). Under the global
    max m = max_i m_i, partition i's share of the full softmax denominator is w_i = l_i * exp(m_i - m),
    and out = sum_i w_i out_i / sum_i w_i. Two passes over the partitions, PARTS_TILE at a time: the
    first finds m, the second sums the weights and the weighted outputs. Only the sequence's own
    cdiv(seq_len, PARTITION_SIZE) partitions are read; the scratch past them was never written.
    The reads are tiny (P x D floats against the partitions' P x PARTITION_SIZE x D of K/V).
    """
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    num_parts = (seq_len + PARTITION_SIZE - 1) // PARTITION_SIZE
    d = tl.arange(0, DIM_PAD)
    dim_ok = d < head_dim
    stats = part_max_ptr + seq * stride_pmt + head * stride_pmh
    sums = part_sum_ptr + seq * stride_pmt + head * stride_pmh
    outs = part_out_ptr + seq * stride_pot + head * stride_poh

    m_seen = tl.full([PARTS_TILE], float("-inf"), tl.float32)
    for first in range(0, num_parts, PARTS_TILE):
        idx = first + tl.arange(0, PARTS_TILE)
        m_seen = tl.maximum(m_seen,
                            tl.load(stats + idx * stride_pmp, mask=idx < num_parts, other=float("-inf")))
    m = tl.max(m_seen, axis=0)

    weight_sum = tl.zeros([PARTS_TILE], tl.float32)
    acc = tl.zeros([DIM_PAD], tl.float32)
    for first in range(0, num_parts, PARTS_TILE):
        idx = first + tl.arange(0, PARTS_TILE)
        part_ok = idx < num_parts
        m_i = tl.load(stats + idx * stride_pmp, mask=part_ok, other=float("-inf"))
        l_i = tl.load(sums + idx * stride_pmp, mask=part_ok, other=0.0)
        o_i = tl.load(outs + idx[:, None] * stride_pop + d[None, :] * stride_pod,
                      mask=part_ok[:, None] & dim_ok[None, :], other=0.0)  # [PARTS_TILE, D]
        w = l_i * tl.exp(m_i - m)  # 0 for the masked lanes: exp(-inf) = 0
        weight_sum += w
        acc += tl.sum(w[:, None] * o_i, axis=0)

    out = acc / tl.sum(weight_sum, axis=0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d * stride_od, out.to(out_ptr.dtype.element_ty),
             mask=dim_ok)


def triton_paged_decode_split(q, k_cache, v_cache, block_tables, seq_lens, scale, partition_size: int = 512,
                              out=None, tile_n: int = 32, max_seq_len: int | None = None,
                              check: bool = True) -> torch.Tensor:
    """Decode like triton_paged_decode, q [B, H, D] -> [B, H, D], with each context cut into partitions
    of partition_size tokens (a power of two and a multiple of the block size; vLLM uses 512).

    triton_paged_decode launches B x kv_heads programs, too few to fill a GPU when a handful of
    sequences are long. Here every partition is its own program (phase 1), and a second small kernel
    merges the partitions (phase 2): B x kv_heads x cdiv(max_seq_len, partition_size) programs,
    for a partial output, max and sum per partition and query head kept in fp32 scratch.
    max_seq_len sizes the grid; pass it to avoid reading seq_lens back to the host (a sync).
    """
    validate_pool(k_cache, v_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_seqs, num_heads = _check_query(q, num_kv_heads, head_dim)
    partition_size = validate_partition_size(partition_size, block_size)
    if check:
        _check_decode(block_tables, seq_lens, num_seqs, num_blocks, block_size)
        if max_seq_len is not None and num_seqs and max_seq_len < int(seq_lens.max()):
            raise ValueError(f"max_seq_len ({max_seq_len}) is below the longest "
                             f"seq_len ({int(seq_lens.max())})")
    block_tables, seq_lens = _rows_contiguous(block_tables), seq_lens.contiguous()
    out = torch.empty_like(q) if out is None else out
    if num_seqs == 0:
        return out
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    num_parts = triton.cdiv(max_seq_len, partition_size)
    part_out = torch.empty(num_seqs, num_heads, num_parts, head_dim, dtype=torch.float32, device=q.device)
    part_max = torch.empty(num_seqs, num_heads, num_parts, dtype=torch.float32, device=q.device)
    part_sum = torch.empty_like(part_max)
    group = num_heads // num_kv_heads
    _paged_decode_partition_kernel[(num_seqs, num_kv_heads, num_parts)](
        q, k_cache, v_cache, part_out, part_max, part_sum, block_tables, seq_lens,
        float(scale),
        *q.stride(), *k_cache.stride(), block_tables.stride(0), *part_out.stride(), *part_max.stride(),
        head_dim,
        GROUP=group, GROUP_PAD=_pow2(group), DIM_PAD=_pow2(head_dim),
        BLOCK_SIZE=block_size, PARTITION_SIZE=partition_size, TILE_N=min(_pow2(tile_n), partition_size),
    )
    _combine_partitions_kernel[(num_seqs, num_heads)](
        part_out, part_max, part_sum, out, seq_lens,
        *part_out.stride(), *part_max.stride(), *out.stride(),
        head_dim,
        DIM_PAD=_pow2(head_dim), PARTITION_SIZE=partition_size, PARTS_TILE=_pow2(min(num_parts, 32)),
    )
    return out


# --------------------------------------------------------------------------------------------------
# 3. Prefill and chunked prefill: many new queries per sequence, causal
# --------------------------------------------------------------------------------------------------
@triton.jit
def prefill_tile(query_start_loc_ptr, seq_lens_ptr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                 GROUP_PAD: tl.constexpr):
    """What a prefill program (sequence, KV head, query tile) works on; the quantized kernel shares it.
    Row r of the tile is new token `token` = q_tile * BLOCK_Q + r // GROUP_PAD of the sequence and head
    `g` = r % GROUP_PAD of the GQA group, at absolute position q_pos = context + token, where context =
    seq_len - query_len. Keys run up to kv_end, the position after the tile's last query. Returns (seq,
    kv_head, q_start, query_len, token, g, q_pos, kv_end); rows with token >= query_len are padding."""
    seq = tl.program_id(0)
    q_tile = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    query_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64) - q_start
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    context = seq_len - query_len
    r = tl.arange(0, BLOCK_M)
    token = q_tile * BLOCK_Q + r // GROUP_PAD
    kv_end = tl.minimum(seq_len, context + (q_tile + 1) * BLOCK_Q)
    return seq, tl.program_id(1), q_start, query_len, token, r % GROUP_PAD, context + token, kv_end


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_cb, stride_cs, stride_ch, stride_cd,
    stride_bt,
    head_dim,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
):
    """Causal attention of a tile of one sequence's new queries over its paged context.

    One program per (sequence, KV head, tile of BLOCK_Q new tokens). As in decode, the program takes
    the GROUP query heads of its KV head, so its query tile has BLOCK_M = BLOCK_Q * GROUP_PAD rows:
    row r is token r // GROUP_PAD of the tile, head r % GROUP_PAD of the group. Tiles past the
    sequence's query_len have nothing to do and return at once (the grid is sized for the longest).

    The sequence's new tokens are the last query_len of its seq_len positions, so new token i sits
    at position context + i, context = seq_len - query_len. Chunked prefill is the case context > 0:
    the earlier chunks' K/V are already in the pool (and this step's were written just before),
    and they are read through the block table exactly like the rest. Query i sees keys 0 .. its
    position; the tile's last query bounds how far the key loop must go.

    Keys are walked in tiles of TILE_N positions, each position mapped through the block table to
    (block, row) as in decode. Here the products are real matrix products, q k^T [BLOCK_M, TILE_N]
    and p v [BLOCK_M, D], so they use tl.dot in fp32 with input_precision="ieee" (not tf32, which
    would cost three decimal digits). Online softmax as in decode.
    """
    seq, kv_head, q_start, query_len, token, g, q_pos, kv_end = prefill_tile(
        query_start_loc_ptr, seq_lens_ptr, BLOCK_Q, BLOCK_M, GROUP_PAD)
    if tl.program_id(2) * BLOCK_Q >= query_len:
        return  # the grid is sized for the longest query
    d = tl.arange(0, DIM_PAD)
    dim_ok = d < head_dim
    row_mask = ((token < query_len) & (g < GROUP))[:, None] & dim_ok[None, :]
    q_rows = (q_start + token) * stride_qt + (kv_head * GROUP + g) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :] * stride_qd, mask=row_mask, other=0.0).to(tl.float32)
    q = q * scale

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)

    table = block_tables_ptr + seq * stride_bt
    head_offset = kv_head * stride_ch
    dim_offsets = d * stride_cd
    for start in range(0, kv_end, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        pos_ok = pos < kv_end
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        rows = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + head_offset

        k_t = tl.load(k_cache_ptr + rows[None, :] + dim_offsets[:, None],
                      mask=pos_ok[None, :] & dim_ok[:, None], other=0.0).to(tl.float32)  # [D, TILE_N]
        s = tl.dot(q, k_t, input_precision="ieee")  # [BLOCK_M, TILE_N]
        visible = pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        v = tl.load(v_cache_ptr + rows[:, None] + dim_offsets[None, :],
                    mask=pos_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)  # [TILE_N, D]
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new

    out = acc / l[:, None]
    o_rows = (q_start + token) * stride_ot + (kv_head * GROUP + g) * stride_oh
    tl.store(out_ptr + o_rows[:, None] + d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty),
             mask=row_mask)


def triton_paged_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out=None,
                         block_m: int = 64, tile_n: int = 64, check: bool = True) -> torch.Tensor:
    """Packed queries q [T, H, D] (sequence b owns rows query_start_loc[b]:query_start_loc[b+1], the
    last tokens of its seq_lens[b]), causal over the paged cache. Handles prefill, chunked prefill
    and decode rows in one batch. Returns [T, H, D]."""
    validate_pool(k_cache, v_cache)
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    num_tokens, num_heads = _check_query(q, num_kv_heads, head_dim)
    if query_start_loc.dim() != 1 or query_start_loc.numel() != seq_lens.numel() + 1:
        raise ValueError(f"query_start_loc must have len(seq_lens)+1 = {seq_lens.numel() + 1} entries, "
                         f"got shape {tuple(query_start_loc.shape)}")
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    if check:
        validate_block_tables(block_tables, seq_lens, num_blocks, block_size)
        if int(query_start_loc[-1]) != num_tokens:
            raise ValueError(f"query_start_loc ends at {int(query_start_loc[-1])} but "
                             f"q has {num_tokens} tokens")
        if (query_lens < 0).any() or (query_lens > seq_lens.to(query_lens.device)).any():
            raise ValueError("each query_len must be between 0 and its seq_len")
    block_tables, seq_lens = _rows_contiguous(block_tables), seq_lens.contiguous()
    query_start_loc = query_start_loc.contiguous()
    out = torch.empty_like(q) if out is None else out
    if num_tokens == 0 or seq_lens.numel() == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = _pow2(group)
    block_m = _pow2(max(block_m, group_pad), at_least=16)  # tl.dot needs >= 16 rows
    block_q = block_m // group_pad
    num_q_tiles = triton.cdiv(int(query_lens.max()), block_q)
    _paged_prefill_kernel[(seq_lens.numel(), num_kv_heads, num_q_tiles)](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc,
        float(scale),
        *q.stride(), *out.stride(), *k_cache.stride(), block_tables.stride(0),
        head_dim,
        GROUP=group, GROUP_PAD=group_pad, DIM_PAD=_pow2(head_dim, at_least=16),
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=_pow2(tile_n, at_least=16),
    )
    return out


def triton_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                           check: bool = True, decode_kernel=None) -> torch.Tensor:
    """The decode kernel (decode_kernel, if given) when every sequence brings exactly one query, the
    prefill kernel otherwise."""
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    if query_lens.numel() and bool((query_lens == 1).all()):
        return triton_paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale, check=check,
                                   kernel=decode_kernel)
    return triton_paged_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                check=check)


# --------------------------------------------------------------------------------------------------
def _check_query(q: torch.Tensor, num_kv_heads: int, head_dim: int) -> tuple[int, int]:
    if q.dim() != 3 or q.shape[2] != head_dim:
        raise ValueError(f"q must be [num_tokens, num_heads, {head_dim}], got {tuple(q.shape)}")
    if q.shape[1] % num_kv_heads:
        raise ValueError(f"q has {q.shape[1]} heads, not a multiple of the pool's {num_kv_heads} kv heads")
    return q.shape[0], q.shape[1]


def _rows_contiguous(block_tables: torch.Tensor) -> torch.Tensor:
    """The kernels step along a block-table row with stride 1 (a column slice keeps that)."""
    return block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()


def _check_decode(block_tables, seq_lens, num_seqs, num_blocks, block_size) -> None:
    if seq_lens.dim() != 1 or seq_lens.numel() != num_seqs:
        raise ValueError(f"decode takes one query per sequence: q has {num_seqs} rows, seq_lens has "
                         f"shape {tuple(seq_lens.shape)}")
    validate_block_tables(block_tables, seq_lens, num_blocks, block_size)
    if num_seqs and int(seq_lens.min()) < 1:
        raise ValueError("decode needs seq_lens >= 1 (the query's own token is in the "
                         f"cache), got {seq_lens.tolist()}")
