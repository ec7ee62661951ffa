"""The paged layout's contract, checked before any kernel reads or writes.

A pool of one layer is [num_blocks, block_size, num_kv_heads, head_dim]; block tables say which
blocks a sequence reads, slot mappings where each new token's K/V goes. An entry outside the pool
would read or write another sequence's memory (or past the pool) without any error, so the torch
path, the Triton kernels and the cache all validate with these functions first.
"""
from __future__ import annotations

import torch

from radarlab.util import cdiv, require_power_of_two


def validate_pool(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """One layer's K and V pools: same 4-D shape [num_blocks, block_size, num_kv_heads, head_dim]."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]; got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    require_power_of_two("block_size (k_cache.shape[1])", k_cache.shape[1])


def validate_block_tables(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int,
                       block_size: int) -> None:
    """Every block a sequence uses must be in the pool. Entries past cdiv(seq_len, block_size) are
    padding (any value, usually -1) and are never read."""
    if block_tables.dim() != 2:
        raise ValueError("block_tables must be [num_seqs, max_blocks], got shape "
                         f"{tuple(block_tables.shape)}")
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


def validate_slot_mapping(slot_mapping: torch.Tensor, num_tokens: int, num_slots: int) -> None:
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


def validate_partition_size(partition_size, block_size: int) -> int:
    """Split-KV decode cuts each context into partitions of partition_size tokens. A power of two, so
    the kernel's tiles (powers of two) divide it; a multiple of block_size, so every block belongs to
    exactly one partition and no block is fetched by two programs."""
    require_power_of_two("partition_size", partition_size)
    if partition_size % block_size:
        raise ValueError(f"partition_size ({partition_size}) must be a multiple of the "
                         f"block size ({block_size}), so that no block is split between two partitions")
    return int(partition_size)
