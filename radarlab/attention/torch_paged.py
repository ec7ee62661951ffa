"""Attention over a paged KV cache in plain torch: gather each sequence's blocks, then do the math.

The pool of one layer is [num_blocks, block_size, num_kv_heads, head_dim] (vLLM's flash layout).
Sequence b's token at position p lives in block block_tables[b, p // block_size], row p % block_size.
Gathering copies a sequence's scattered blocks back into one contiguous [seq_len, kv_heads, dim]
tensor, so the attention itself is exactly attention_reference. That copy is what the Triton kernels
(triton_paged.py) avoid: they read the blocks in place.

The input checks (block tables, slot mappings, pools) live in layout.py, shared with the Triton path
and the cache.
"""
from __future__ import annotations

import torch

from radarlab.attention.layout import validate_block_tables, validate_pool
from radarlab.attention.reference import attention_reference
from radarlab.util import cdiv


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len tokens of one sequence, copied out of the pool: [seq_len, kv_heads, dim]."""
    block_size = cache.shape[1]
    blocks = block_table[: cdiv(seq_len, block_size)].long()
    return cache[blocks].flatten(0, 1)[:seq_len]


def paged_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                          check: bool = True) -> torch.Tensor:
    """Causal attention for packed queries q [T, H, D] over the paged cache.

    Sequence b's queries are q[query_start_loc[b]:query_start_loc[b+1]], the last tokens of its
    seq_lens[b] tokens of context (prefill, chunked prefill and decode are all this one case).
    Sequences with one query (decodes) run together through paged_decode_torch; the others
    (prefill chunks) one at a time. A Python loop over 64 decodes per layer would cost more than
    the attention math itself.
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
        out[rows] = paged_decode_torch(q[rows], k_cache, v_cache, block_tables[seqs], seq_lens[seqs.to(seq_lens.device)],
                                       scale, check=False)
    done = set(decodes)
    for b, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = bounds[b], bounds[b + 1]
        if b in done or lo == hi:
            continue
        k = gather_kv(k_cache, block_tables[b], seq_len)
        v = gather_kv(v_cache, block_tables[b], seq_len)
        out[lo:hi] = attention_reference(q[lo:hi], k, v, scale, causal=True)
    return out


def paged_decode_torch(q, k_cache, v_cache, block_tables, seq_lens, scale, check: bool = True) -> torch.Tensor:
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
    # Only the columns the longest sequence needs; entries past a sequence's last block are padding
    # (often -1, which torch indexing would wrap around), so point them at block 0 and mask them below.
    needed = cdiv(seq_lens.to(block_tables.device).long(), k_cache.shape[1])
    width = int(needed.max()) if num_seqs else 0
    used = torch.arange(width, device=block_tables.device)[None, :] < needed[:, None]
    blocks = torch.where(used, block_tables[:, :width].long(), 0)
    k = k_cache[blocks].flatten(1, 2).float()  # [B, width*block_size, kv_heads, D]
    v = v_cache[blocks].flatten(1, 2).float()
    qg = q.float().view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("bhgd,bthd->bhgt", qg, k) * scale
    visible = torch.arange(k.shape[1], device=q.device)[None, :] < seq_lens.to(q.device)[:, None]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    v = v.masked_fill(~visible[:, :, None, None], 0.0)  # rows past seq_len may hold anything, even NaN
    out = torch.einsum("bhgt,bthd->bhgd", torch.softmax(scores, dim=-1), v)
    return out.reshape(num_seqs, num_heads, head_dim).to(q.dtype)
