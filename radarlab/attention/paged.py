"""Attention over a paged KV cache in plain torch: gather each sequence's blocks, then do the math.

The pool of one layer is [num_blocks, block_size, num_kv_heads, head_dim] (vLLM's flash layout).
Sequence b's token at position p lives in block block_tables[b, p // block_size], row p % block_size.
Gathering copies a sequence's scattered blocks back into one contiguous [seq_len, kv_heads, dim]
tensor, so the attention itself is exactly attention_reference. That copy is what the Triton kernels
(triton_paged.py) avoid: they read the blocks in place.

The checks live here too, because the torch path, the Triton path and the cache all need them: a
block table entry or slot outside the pool would read or write another sequence's memory (or past
the pool), so it must fail loudly before any kernel runs.
"""
from __future__ import annotations

import torch

from radarlab.attention.reference import attention_reference


def cdiv(a, b):
    """Ceiling division for ints and integer tensors."""
    return -(-a // b)


def check_block_size(block_size) -> None:
    """Block sizes are powers of two: 1 (one token per block, for teaching), 2, 4, ..., 16 (default)."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0 \
            or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two (1, 2, 4, 8, 16, ...), got {block_size!r}")


def check_pool(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """One layer's K and V pools: same 4-D shape [num_blocks, block_size, num_kv_heads, head_dim]."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]; got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    check_block_size(k_cache.shape[1])


def check_block_tables(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int,
                       block_size: int) -> None:
    """Every block a sequence uses must be in the pool. Entries past cdiv(seq_len, block_size) are
    padding (any value, usually -1) and are never read."""
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [num_seqs, max_blocks], got shape {tuple(block_tables.shape)}")
    if block_tables.shape[0] != seq_lens.numel():
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows; expected one per sequence "
                         f"({seq_lens.numel()} seq_lens)")
    if seq_lens.numel() == 0:
        return
    if (seq_lens < 0).any():
        raise ValueError(f"seq_lens must be non-negative, got {seq_lens.tolist()}")
    needed = cdiv(seq_lens.to(block_tables.device).long(), block_size)
    if int(needed.max()) > block_tables.shape[1]:
        b = int(needed.argmax())
        raise ValueError(f"sequence {b} has seq_len {int(seq_lens[b])} and needs {int(needed[b])} blocks of "
                         f"{block_size}, but block_tables has only {block_tables.shape[1]} columns")
    used = torch.arange(block_tables.shape[1], device=block_tables.device)[None, :] < needed[:, None]
    bad = used & ((block_tables < 0) | (block_tables >= num_blocks))
    if bad.any():
        b, i = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"block_tables[{b}, {i}] = {int(block_tables[b, i])} is outside the pool "
                         f"(valid block ids: 0..{num_blocks - 1})")


def check_slot_mapping(slot_mapping: torch.Tensor, num_tokens: int, num_slots: int) -> None:
    """One slot per new token, each in [0, num_slots) or -1 (padding: the write skips it)."""
    if slot_mapping.dim() != 1 or slot_mapping.numel() != num_tokens:
        raise ValueError(f"slot_mapping must be 1-D with one entry per token ({num_tokens}), got shape "
                         f"{tuple(slot_mapping.shape)}")
    if slot_mapping.dtype.is_floating_point:
        raise ValueError(f"slot_mapping must hold integers, got {slot_mapping.dtype}")
    bad = (slot_mapping < -1) | (slot_mapping >= num_slots)
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"slot_mapping[{i}] = {int(slot_mapping[i])} is outside the pool (valid slots: "
                         f"0..{num_slots - 1}, or -1 for padding)")


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
        check_pool(k_cache, v_cache)
        check_block_tables(block_tables, seq_lens, k_cache.shape[0], k_cache.shape[1])
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
        check_pool(k_cache, v_cache)
        check_block_tables(block_tables, seq_lens, k_cache.shape[0], k_cache.shape[1])
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
