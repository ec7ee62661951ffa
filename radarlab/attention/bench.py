"""Inputs and measurements for the paged-attention kernels: random paged batches, what a decode step
must move, and the decode bandwidth sweep.

Decode is memory-bound: per context token and KV head it reads 2 x head_dim values (K and V) and does
4 x group x head_dim FLOPs with them (q.k and p.v for each of the group's query heads), about
2 x group / bytes_per_value FLOP per byte. A GPU's ridge point is in the hundreds, so the time of a
decode kernel is set by bytes / bandwidth, and its yardstick is achieved bandwidth: the bytes it must
move divided by its time, next to the memory's peak (a bandwidth roofline).

random_paged_batch builds inputs the way the tests do: each sequence's K/V scattered through a
shuffled block table into a pool whose unused slots hold NaN, so a kernel that reads a slot it should
not returns NaN instead of a plausible number.

Timing is radarlab.hardware.measure's time_ms (do_bench on CUDA).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from radarlab.attention.reference import attention_reference
from radarlab.attention.torch_paged import paged_decode_torch
from radarlab.hardware.measure import time_ms
from radarlab.util import cdiv, require_int, require_power_of_two


@dataclass
class PagedBatch:
    """A batch of sequences in one layer's paged pool, with the unpaged K/V kept for the reference."""

    q: torch.Tensor  # [T, H, D] packed queries: sequence b owns query_start_loc[b]:query_start_loc[b+1]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 past each sequence's last block
    seq_lens: torch.Tensor  # [B] int64
    query_start_loc: torch.Tensor  # [B+1] int64
    scale: float
    keys: list[torch.Tensor] = field(repr=False)  # sequence b's K, [seq_lens[b], Hkv, D], before paging
    values: list[torch.Tensor] = field(repr=False)

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[1]

    @property
    def query_lens(self) -> list[int]:
        return (self.query_start_loc[1:] - self.query_start_loc[:-1]).tolist()

    def reference(self) -> torch.Tensor:
        """attention_reference over each sequence's unpaged K/V: what every paged path must return (fp32)."""
        bounds = self.query_start_loc.tolist()
        outs = [attention_reference(self.q[lo:hi].float(), k.float(), v.float(), self.scale, causal=True)
                for lo, hi, k, v in zip(bounds[:-1], bounds[1:], self.keys, self.values)]
        return torch.cat(outs) if outs else torch.empty(0, *self.q.shape[1:], device=self.q.device)


def random_paged_batch(seq_lens: Sequence[int], query_lens: Sequence[int] | None = None, block_size: int = 16,
                       num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16, *, seed: int = 0,
                       device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                       spare_blocks: int = 2, poison: bool = True) -> PagedBatch:
    """Random q and K/V for sequences of seq_lens tokens, paged through shuffled block tables.

    query_lens[b] new tokens per sequence (the last ones of its seq_lens[b]); default 1 each, a decode
    step. spare_blocks extra blocks belong to nobody. With poison, every slot no sequence owns holds
    NaN (the tail of a last block, the spare blocks); without it (benchmarks) the pool is left as
    torch.empty made it.
    """
    seq_lens = [int(s) for s in seq_lens]
    query_lens = [1] * len(seq_lens) if query_lens is None else [int(n) for n in query_lens]
    if not seq_lens:
        raise ValueError("seq_lens is empty: a batch needs at least one sequence")
    if len(query_lens) != len(seq_lens):
        raise ValueError(f"query_lens has {len(query_lens)} entries, seq_lens has {len(seq_lens)}")
    for b, (s, n) in enumerate(zip(seq_lens, query_lens)):
        if s < 1 or not 0 <= n <= s:
            raise ValueError(f"sequence {b}: need seq_len >= 1 and 0 <= query_len <= seq_len, got {s} and {n}")
    require_power_of_two("block_size", block_size)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")

    gen = torch.Generator(device=device).manual_seed(seed)
    per_seq = [cdiv(s, block_size) for s in seq_lens]
    num_blocks = sum(per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen, device=device)  # shuffled: no sequence is contiguous
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.empty(shape, dtype=dtype, device=device)
    v_cache = torch.empty(shape, dtype=dtype, device=device)
    if poison:
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))
    tables = torch.full((len(seq_lens), max(per_seq)), -1, dtype=torch.int32, device=device)
    keys, values, first = [], [], 0
    for b, seq_len in enumerate(seq_lens):
        blocks = order[first:first + per_seq[b]]
        first += per_seq[b]
        tables[b, :per_seq[b]] = blocks.to(torch.int32)
        pos = torch.arange(seq_len, device=device)
        slots = blocks[pos // block_size] * block_size + pos % block_size
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = k
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = v
        keys.append(k)
        values.append(v)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen, device=device).to(dtype)
    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.long, device=device)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens, device=device), 0)
    return PagedBatch(q, k_cache, v_cache, tables, torch.tensor(seq_lens, device=device), qsl,
                      head_dim ** -0.5, keys, values)


# --------------------------------------------------------------------------------------------------
# What a decode step must move, and what it computes

def _check_decode_shape(seq_lens, num_heads, num_kv_heads, head_dim) -> list[int]:
    seq_lens = [int(s) for s in seq_lens]
    if not seq_lens or min(seq_lens) < 1:
        raise ValueError(f"seq_lens must be a non-empty list of lengths >= 1, got {seq_lens}")
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        require_int(name, value)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    return seq_lens


def decode_bytes(seq_lens: Sequence[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 bytes_per_value: int, index_bytes: int = 4) -> int:
    """The least memory traffic of one paged decode step, in bytes.

    K and V of every context token, once per KV head (a GQA group shares the read); each query read
    and each output written; and the block-table entries the sequences use (index_bytes each, int32).
    Anything a kernel moves beyond this (re-reads, the gather's copy) is overhead.
    """
    seq_lens = _check_decode_shape(seq_lens, num_heads, num_kv_heads, head_dim)
    require_power_of_two("block_size", block_size)
    kv = 2 * sum(seq_lens) * num_kv_heads * head_dim * bytes_per_value
    q_and_out = 2 * len(seq_lens) * num_heads * head_dim * bytes_per_value
    table = sum(cdiv(s, block_size) for s in seq_lens) * index_bytes
    return kv + q_and_out + table


def decode_flops(seq_lens: Sequence[int], num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """FLOPs of one decode step's attention: q.k and p.v, a multiply-add (2 FLOPs) per value, for
    every query head and context token. (The softmax's exps and sums are left out.)"""
    seq_lens = _check_decode_shape(seq_lens, num_heads, num_kv_heads, head_dim)
    return 4 * sum(seq_lens) * num_heads * head_dim


# --------------------------------------------------------------------------------------------------
# Decode against the bandwidth roofline

@dataclass(frozen=True)
class DecodeBandwidth:
    """One point of the roofline: a decode step of `batch` sequences of `context` tokens each."""

    batch: int
    context: int
    nbytes: int  # decode_bytes for these shapes
    triton_ms: float  # best over the tile sizes tried
    tile_n: int
    torch_ms: float  # paged_decode_torch: gather, then the math
    max_error: float  # Triton against the fp32 reference

    @property
    def triton_gbps(self) -> float:
        return self.nbytes / self.triton_ms / 1e6

    @property
    def torch_gbps(self) -> float:
        return self.nbytes / self.torch_ms / 1e6


def measure_decode_bandwidth(contexts: Sequence[int], batch: int, num_heads: int = 9, num_kv_heads: int = 3,
                             head_dim: int = 64, block_size: int = 16, dtype: torch.dtype = torch.bfloat16,
                             device: str | torch.device = "cuda", tiles: Sequence[int] = (16, 32, 64),
                             seed: int = 0) -> list[DecodeBandwidth]:
    """Time triton_paged_decode (best of `tiles`) and the torch gather path for each context length.

    Every sequence has `context` tokens in scattered blocks. The Triton output is checked against the
    fp32 reference before it is timed; the timed calls skip the argument checks (check=False), which
    would add host syncs. The defaults are the course model's heads.
    """
    from radarlab.attention.triton_paged import triton_paged_decode

    rows = []
    for context in contexts:
        b = random_paged_batch([context] * batch, None, block_size, num_heads, num_kv_heads, head_dim,
                               seed=seed, device=device, dtype=dtype, spare_blocks=0, poison=False)
        args = (b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.scale)
        out = triton_paged_decode(*args)
        error = (out.float() - b.reference()).abs().max().item()
        best_ms, best_tile = float("inf"), None
        for tile in tiles:
            ms = time_ms(lambda: triton_paged_decode(*args, out=out, tile_n=tile, check=False), device)
            if ms < best_ms:
                best_ms, best_tile = ms, tile
        torch_ms = time_ms(lambda: paged_decode_torch(*args, check=False), device)
        nbytes = decode_bytes([context] * batch, num_heads, num_kv_heads, head_dim, block_size,
                              b.k_cache.element_size(), b.block_tables.element_size())
        rows.append(DecodeBandwidth(batch, context, nbytes, best_ms, best_tile, torch_ms, error))
        del b, args, out
        if str(device).startswith("cuda"):
            torch.cuda.empty_cache()
    return rows
