"""Attention over a paged KV cache in plain torch: gather each sequence's blocks, then do the math.

The pool of one layer is [num_blocks, block_size, num_kv_heads, head_dim] (vLLM's flash layout).
Sequence b's token at position p lives in block block_tables[b, p // block_size], row p % block_size.
Gathering copies a sequence's scattered blocks back into one contiguous [seq_len, kv_heads, dim]
tensor, so the attention itself is exactly attention_reference. That copy is what the Triton kernels
(triton_paged.py) avoid: they read the blocks in place.

split_kv_decode_torch is the same decode done the way a split-KV (flash-decoding) kernel does it:
per-partition partial softmax, then a combine. It is the readable reference of that two-phase math.

The input checks (block tables, slot mappings, pools) live in layout.py, shared with the Triton path
and the cache.
"""
from __future__ import annotations

import torch

from radarlab.attention.layout import validate_block_tables, validate_partition_size, validate_pool
from radarlab.attention.reference import attention_reference, attention_settled
from radarlab.util import cdiv


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len tokens of one sequence, copied out of the pool: [seq_len, kv_heads, dim]."""
    block_size = cache.shape[1]
    blocks = block_table[: cdiv(seq_len, block_size)].long()
    return cache[blocks].flatten(0, 1)[:seq_len]


def paged_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                          check: bool = True, settling=None) -> torch.Tensor:
    """Causal attention for packed queries q [T, H, D] over the paged cache.

    Sequence b's queries are q[query_start_loc[b]:query_start_loc[b+1]], the last tokens of its
    seq_lens[b] tokens of context (prefill, chunked prefill and decode are all this one case).
    Sequences with one query (decodes) run together through paged_decode_torch; the others
    (prefill chunks) one at a time. A Python loop over 64 decodes per layer would cost more than
    the attention math itself.

    settling = (k_fresh, v_fresh, settled_len): a cache that stores positions lossily only once later
    tokens exist (KIVI's key groups). k_fresh, v_fresh are pools with this step's positions before
    they settled, settled_len(n) how many of n tokens are settled; a query at position t then reads
    what it would have read as the newest token (attention_settled). A decode is the newest token
    already, so decodes read the cache as it is.
    """
    if check:
        validate_pool(k_cache, v_cache)
        validate_block_tables(block_tables, seq_lens, k_cache.shape[0], k_cache.shape[1])
    out = torch.empty_like(q)
    bounds = query_start_loc.tolist()
    query_lens = [hi - lo for lo, hi in zip(bounds, bounds[1:])]
    decodes = [b for b, n in enumerate(query_lens) if n == 1]
    if decodes:
        rows = torch.tensor([bounds[b] for b in decodes], device=q.device)
        seqs = torch.tensor(decodes, device=block_tables.device)
        out[rows] = paged_decode_torch(q[rows], k_cache, v_cache, block_tables[seqs],
                                       seq_lens[seqs.to(seq_lens.device)], scale, check=False)
    done = set(decodes)
    for b, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = bounds[b], bounds[b + 1]
        if b in done or lo == hi:
            continue
        k = gather_kv(k_cache, block_tables[b], seq_len)
        v = gather_kv(v_cache, block_tables[b], seq_len)
        if settling is None:
            out[lo:hi] = attention_reference(q[lo:hi], k, v, scale, causal=True)
            continue
        k_fresh, v_fresh, settled_len = settling
        settled = torch.tensor([settled_len(t + 1) for t in range(seq_len - (hi - lo), seq_len)])
        out[lo:hi] = attention_settled(q[lo:hi], k, v, gather_kv(k_fresh, block_tables[b], seq_len),
                                       gather_kv(v_fresh, block_tables[b], seq_len), settled, scale)
    return out


def paged_decode_torch(q, k_cache, v_cache, block_tables, seq_lens, scale,
                       check: bool = True) -> torch.Tensor:
    """Decode (one query per sequence, q [B, H, D]) for the whole batch at once, without a Python loop.

    It gathers every sequence's full block-table row, [B, max_blocks * block_size, kv_heads, dim],
    and masks positions past seq_len. This is the fastest plain-torch path and the baseline the
    Triton decode kernel is timed against: it pays for a padded copy of all K/V before any math.
    """
    if check:
        validate_pool(k_cache, v_cache)
        validate_block_tables(block_tables, seq_lens, k_cache.shape[0], k_cache.shape[1])
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_seqs != block_tables.shape[0]:
        raise ValueError(f"q has {num_seqs} rows but there are {block_tables.shape[0]} sequences; decode "
                         f"takes exactly one query per sequence")
    k, v, visible = _gather_batch(k_cache, v_cache, block_tables, seq_lens, q.device)
    qg = q.float().view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("bhgd,bthd->bhgt", qg, k) * scale
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    out = torch.einsum("bhgt,bthd->bhgd", torch.softmax(scores, dim=-1), v)
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)


def _gather_batch(k_cache, v_cache, block_tables, seq_lens, device):
    """Every sequence's K and V as fp32 [B, T, kv_heads, D] (T: the longest sequence's blocks), with
    visible [B, T] marking positions < seq_len. V past seq_len is zeroed: those rows may hold
    anything, even NaN, and a zero weight times NaN would still be NaN."""
    # Only the columns the longest sequence needs; entries past a sequence's last block are padding
    # (often -1, which torch indexing would wrap around), so point them at block 0 and mask them below.
    needed = cdiv(seq_lens.to(block_tables.device).long(), k_cache.shape[1])
    width = int(needed.max()) if needed.numel() else 0
    used = torch.arange(width, device=block_tables.device)[None, :] < needed[:, None]
    blocks = torch.where(used, block_tables[:, :width].long(), 0)
    k = k_cache[blocks].flatten(1, 2).float()
    v = v_cache[blocks].flatten(1, 2).float()
    visible = torch.arange(k.shape[1], device=device)[None, :] < seq_lens.to(device)[:, None]
    return k, v.masked_fill(~visible[:, :, None, None], 0.0), visible


def split_kv_decode_torch(q, k_cache, v_cache, block_tables, seq_lens, scale, partition_size: int = 512,
                          check: bool = True) -> torch.Tensor:
    """Decode as split-KV (flash-decoding) computes it: phase 1, split_kv_partials_torch, attends each
    partition of partition_size tokens on its own; phase 2, combine_partitions_torch, merges them.
    The reference of triton_paged_decode_split; equal to paged_decode_torch up to fp32 rounding."""
    outs, maxes, sums = split_kv_partials_torch(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                                partition_size, check)
    return combine_partitions_torch(outs, maxes, sums).to(q.dtype)


def split_kv_partials_torch(q, k_cache, v_cache, block_tables, seq_lens, scale, partition_size: int = 512,
                            check: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Phase 1 of split-KV decode: partition i of a sequence holds positions
    [i * partition_size, (i + 1) * partition_size), and each partition is attended as if it were the
    whole context. Returns, per (sequence, query head, partition), all fp32:

    - outs [B, H, P, D]: softmax over the partition's scores only, times its V;
    - maxes [B, H, P]: m_i, the partition's largest score (scale included);
    - sums [B, H, P]: l_i, the sum of exp(score - m_i) over the partition.

    P = cdiv(longest seq_len, partition_size). A partition past a sequence's end is empty:
    m_i = -inf, l_i = 0, out 0, so the combine gives it no weight.
    """
    if check:
        validate_pool(k_cache, v_cache)
        validate_block_tables(block_tables, seq_lens, k_cache.shape[0], k_cache.shape[1])
        if q.dim() != 3 or q.shape[1] % k_cache.shape[2] or q.shape[2] != k_cache.shape[3]:
            raise ValueError(f"q must be [num_seqs, a multiple of {k_cache.shape[2]} "
                             f"heads, {k_cache.shape[3]}] to match the pool, got {tuple(q.shape)}")
        if q.shape[0] != seq_lens.numel():
            raise ValueError(f"q has {q.shape[0]} rows but seq_lens has "
                             f"{seq_lens.numel()}; decode takes exactly one query per sequence")
        if seq_lens.numel() and int(seq_lens.min()) < 1:
            raise ValueError(f"decode needs seq_lens >= 1, got {seq_lens.tolist()}")
    validate_partition_size(partition_size, k_cache.shape[1])
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads

    k, v, visible = _gather_batch(k_cache, v_cache, block_tables, seq_lens, q.device)
    num_parts = cdiv(k.shape[1], partition_size)
    pad = num_parts * partition_size - k.shape[1]  # round the context up to whole partitions
    k = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad)).view(num_seqs, num_parts, partition_size,
                                                              num_kv_heads, -1)
    v = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad)).view(num_seqs, num_parts, partition_size,
                                                              num_kv_heads, -1)
    visible = torch.nn.functional.pad(visible, (0, pad)).view(num_seqs, 1, 1, num_parts, partition_size)

    qg = q.float().view(num_seqs, num_kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,bpshd->bhgps", qg, k) * scale  # [B, Hkv, G, P, S]
    scores = scores.masked_fill(~visible, float("-inf"))
    maxes = scores.amax(dim=-1)  # -inf for an empty partition
    # An empty partition has no maximum to subtract; any finite shift gives exp(-inf) = 0 for its scores.
    p = torch.exp(scores - torch.where(maxes.isinf(), 0.0, maxes)[..., None])
    sums = p.sum(dim=-1)
    acc = torch.einsum("bhgps,bpshd->bhgpd", p, v)
    outs = torch.where(sums[..., None] > 0, acc / sums[..., None], 0.0)
    return (outs.reshape(num_seqs, num_heads, num_parts, head_dim),
            maxes.reshape(num_seqs, num_heads, num_parts), sums.reshape(num_seqs, num_heads, num_parts))


def combine_partitions_torch(outs: torch.Tensor, maxes: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """Phase 2 of split-KV decode: merge the partitions' partial results into the full softmax.

    Partition i's out_i was normalised by its own l_i under its own max m_i. Under the global max
    m = max_i m_i, its share of the full softmax's denominator is w_i = l_i * exp(m_i - m), so

        out = sum_i w_i * out_i / sum_i w_i.

    The exp(m_i - m) rescale is the same correction online softmax applies tile by tile; without it
    a partition of tiny scores would count as much as one holding the real maximum.
    """
    m = maxes.amax(dim=-1, keepdim=True)  # finite: every sequence has at least one token
    weights = sums * torch.exp(maxes - m)  # [B, H, P]; 0 for an empty partition
    return (weights[..., None] * outs).sum(dim=-2) / weights.sum(dim=-1)[..., None]
