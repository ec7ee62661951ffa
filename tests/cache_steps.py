"""Inputs for cache and attention tests: seeded tensors and one step's metadata built by hand."""
from __future__ import annotations

import torch

from radarlab.attention.metadata import AttentionMetadata


def seeded(*shape, seed: int, half_exact: bool = False) -> torch.Tensor:
    """Standard normal values; half_exact rounds them to numbers fp16 holds exactly, so a cache that
    keeps some tokens in 16-bit (tails, sinks) stores the very numbers a test's reference uses."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    return x.half().float() if half_exact else x


def step_metadata(news, totals, tables, block_size: int) -> AttentionMetadata:
    """Sequence i brings the last news[i] of its totals[i] tokens; its slots come from tables[i]."""
    slots = [t[p // block_size] * block_size + p % block_size for t, n, total in zip(tables, news, totals)
             for p in range(total - n, total)]
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [-1] * (width - len(t)) for t in tables])
    return AttentionMetadata.from_lens(news, totals, slot_mapping=torch.tensor(slots), block_tables=bt)
