"""The baseline cache: one preallocated row of max_len positions per sequence.

This is what a naive server does: reserve the worst case up front. It is simple and fast to index,
and it wastes every position a sequence never reaches (notebook 02 measures how much). Attention
over it is radarlab.attention.backends.contiguous_attn.
"""
from __future__ import annotations

import torch

from radarlab.util import require_int


class KVCacheFull(RuntimeError):
    """A sequence needs more positions than its cache row (or the pool) holds."""


class ContiguousKVCache:
    """K and V shaped [num_layers, max_seqs, max_len, num_kv_heads, head_dim]."""

    def __init__(
        self,
        num_layers: int,
        max_seqs: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> None:
        for name, value in [("num_layers", num_layers), ("max_seqs", max_seqs), ("max_len", max_len),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)]:
            require_int(name, value)
        shape = (num_layers, max_seqs, max_len, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len

    @classmethod
    def for_model(cls, config, max_seqs: int, max_len: int, dtype=torch.float32,
                  device="cpu") -> "ContiguousKVCache":
        return cls(config.num_layers, max_seqs, max_len, config.num_kv_heads, config.head_dim, dtype, device)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def append_to_row(k_cache, v_cache, row: int, seq_len: int, k, v):
    """The contiguous cache's whole write: the n newest tokens' k, v [n, kv_heads, D] go to positions
    seq_len - n .. seq_len - 1 of `row` (in place, in one layer's [max_seqs, max_len, kv_heads, D]
    tensors), and the row's first seq_len positions come back: the context attention reads."""
    start = seq_len - k.shape[0]
    k_cache[row, start:seq_len] = k
    v_cache[row, start:seq_len] = v
    return k_cache[row, :seq_len], v_cache[row, :seq_len]
