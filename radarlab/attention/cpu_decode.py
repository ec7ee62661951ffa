"""Paged decode attention in C++ for the CPU: the blocks read in place, fp32 accumulation.

sdpa_paged.py gets torch's fused SDPA kernel to do paged attention by first gathering each decode's
K/V rows into one padded tensor. On the engine's batch-64 decode step, that gather plus the padded
SDPA call were about a third of the step (notebook 05's profile). vLLM's CPU kernels never make that
copy: they walk each sequence's block table. radarlab/csrc/paged_decode.cpp is such a kernel,
written for this course: one work item per sequence (per KV head at small batch), torch's thread
pool, K/V rows widened to fp32 one at a time, the GQA group's queries sharing each row.

It is one of radarlab's C++ operators (radarlab.cpu_ops): torch.ops.radarlab.paged_decode.
"""
from __future__ import annotations

import torch

from radarlab.attention.layout import validate_block_tables, validate_pool
from radarlab.cpu_ops import load_cpu_ops


def paged_decode_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, out: torch.Tensor | None = None,
                     rows: torch.Tensor | None = None, check: bool = True) -> torch.Tensor:
    """Decode attention: q [T, H, D], one query per sequence (row rows[i] for sequence i, or row i),
    over pools [num_blocks, block_size, kv_heads, D]; returns out [T, H, D] in q's dtype. Rows of out
    that no sequence names are left as they were (zeros in a new out).

    check=True validates the block tables and rows and converts them to the op's int32/int64
    contiguous form. The engine's step plan (sdpa_paged.plan_paged_sdpa) has done both once per step,
    so every layer passes check=False."""
    if check:
        validate_pool(k_cache, v_cache)
        validate_block_tables(block_tables, seq_lens, k_cache.shape[0], k_cache.shape[1])
        if rows is None and q.shape[0] != seq_lens.numel():
            raise ValueError(f"q has {q.shape[0]} rows for {seq_lens.numel()} sequences; pass "
                             "rows to say which is whose")
        if rows is not None and ((rows < 0) | (rows >= q.shape[0])).any():
            raise ValueError(f"rows must index q's {q.shape[0]} rows, got {rows.tolist()}")
        if bool((seq_lens < 1).any()):
            raise ValueError("every decoding sequence needs at least one token of "
                             f"context, got {seq_lens.tolist()}")
        block_tables = block_tables.to(torch.int32).contiguous()
        seq_lens = seq_lens.to(torch.int32).contiguous()
        rows = None if rows is None else rows.long().contiguous()
    if out is None:
        out = torch.zeros_like(q, memory_format=torch.contiguous_format)
    q = q if q.stride(2) == 1 else q.contiguous()
    load_cpu_ops().paged_decode(out, q, k_cache, v_cache, block_tables, seq_lens, rows, float(scale))
    return out
