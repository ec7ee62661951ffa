"""The worker side of the block tables: the tensor the kernels read, and the one slot formula.

The scheduler side keeps each sequence's block ids as a Python list (KVCacheBlocks, in
kv_cache_manager). A step hands those lists to the model runner, which turns them into an int32
tensor [B, max_blocks] (vLLM's worker-side BlockTable, vllm/v1/worker/block_table.py) and computes
every new token's slot from it:

    slot = block_table[b, p // block_size] * block_size + p % block_size

the row of the pool, viewed as [num_blocks * block_size, num_kv_heads, head_dim], where position p
of sequence b lives. Every tensor slot mapping in radarlab comes from compute_slot_mapping.
"""
from __future__ import annotations

from typing import Sequence

import torch


def block_table_tensor(block_ids: Sequence[Sequence[int]], width: int | None = None, pad: int = -1,
                       device: str | torch.device | None = None) -> torch.Tensor:
    """int32 [B, width] of the sequences' block ids, row b padded with `pad` (default: the longest row).

    The default pad, -1, is never a block id, so a stray read is easy to spot. Kernels must stop at
    cdiv(seq_len, block_size) and never read a pad entry; torch indexing would wrap -1 to the last
    block silently. vLLM pads with 0; pass pad=0 for that. A row longer than width is cut (the blocks
    past a step's context are not read).
    """
    width = max((len(ids) for ids in block_ids), default=0) if width is None else width
    out = torch.full((len(block_ids), width), pad, dtype=torch.int32)
    for row, ids in enumerate(block_ids):
        ids = list(ids[:width])
        out[row, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return out if device is None else out.to(device)


def compute_slot_mapping(block_table: torch.Tensor, positions: torch.Tensor, block_size: int,
                         req_indices: torch.Tensor | None = None) -> torch.Tensor:
    """int64 slots of positions, looked up in block_table [B, max_blocks].

    With req_indices [N], positions [N] are packed tokens, token i of sequence req_indices[i] (a
    step's slot mapping, as vLLM's BlockTable.compute_slot_mapping). Without, positions [B, T] are
    row b's positions in sequence b (the keys a query reads)."""
    block_idx = torch.div(positions, block_size, rounding_mode="floor")
    if req_indices is None:
        blocks = block_table.long().gather(1, block_idx)
    else:
        blocks = block_table.long()[req_indices, block_idx]
    return blocks * block_size + positions % block_size


def group_slots(blocks: torch.Tensor, groups: torch.Tensor, group_size: int, block_size: int) -> torch.Tensor:
    """Slots [n, group_size] of group groups[i] of block blocks[i] (a block holds block_size //
    group_size groups of consecutive positions: KIVI quantizes keys a group at a time)."""
    offsets = (groups * group_size)[:, None] + torch.arange(group_size, device=blocks.device)
    return compute_slot_mapping(blocks[:, None], offsets, block_size)
