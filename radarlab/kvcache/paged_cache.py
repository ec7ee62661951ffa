"""The paged KV cache: per-layer pools of fixed-size blocks, written by slot mapping, read by block table.

Instead of reserving max_len positions per sequence (contiguous.py), memory is cut into blocks of
block_size tokens. A sequence owns a list of blocks (its block table, kept by the block manager in
block_table.py) and grows one block at a time, so at most block_size - 1 positions per sequence are
ever wasted. The pool of one layer is [num_blocks, block_size, num_kv_heads, head_dim], vLLM's flash
layout: one token's K (or V) for all heads is one contiguous row, and so is a whole block.

Two indirections, with vLLM's names:
- slot mapping (writes): new token t goes to slot = block_id * block_size + offset; -1 means
  padding and is skipped;
- block tables (reads): block_tables[b, i] is the physical block holding sequence b's positions
  i*block_size .. (i+1)*block_size - 1.

The cache does not choose blocks; the caller (the block manager, via AttentionMetadata) does.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Iterable

import torch

from radarlab.attention.metadata import AttentionMetadata
from radarlab.attention.layout import validate_block_tables, validate_slot_mapping
from radarlab.attention.sdpa_paged import paged_attention_sdpa, plan_paged_sdpa
from radarlab.util import require_int, require_power_of_two

def reshape_and_cache(k, v, k_cache, v_cache, slot_mapping) -> None:
    """The KV write in torch: token t's k[t], v[t] ([kv_heads, D]) go to slot_mapping[t], -1 skipped.

    Named after vLLM's op (the new K/V arrive as [T, kv_heads, D] and are "reshaped" into blocks).
    The caller validates the slots (validate_slot_mapping).
    """
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    # A pool [num_blocks, block_size, ...] viewed as [num_slots, ...]: slot s is row s.
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v.to(v_cache.dtype)


class PagedKVCache:
    """K and V pools shaped [num_layers, num_blocks, block_size, num_kv_heads, head_dim].

    self.k[layer] is one layer's pool. backend picks how writes and attention run: "torch" (gather
    the context's rows, then torch's fused SDPA; sdpa_paged.py) or "triton" (kernels that read the
    blocks in place).
    """

    BACKENDS = ("torch", "triton")

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        backend: str = "torch",
    ) -> None:
        for name, value in [("num_layers", num_layers), ("num_blocks", num_blocks),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)]:
            require_int(name, value)
        require_power_of_two("block_size", block_size)
        if backend not in self.BACKENDS:
            raise ValueError(f"backend must be one of {self.BACKENDS}, got {backend!r}")
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.backend = backend

    @classmethod
    def for_model(cls, config, num_blocks: int, block_size: int = 16, dtype=torch.float32, device="cpu",
                  backend: str = "torch") -> "PagedKVCache":
        return cls(config.num_layers, num_blocks, config.num_kv_heads, config.head_dim, block_size,
                   dtype, device, backend)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store this step's k, v [T, kv_heads, D] of one layer at slot_mapping [T] (-1 = padding)."""
        self._check_kv(layer, k, v)
        slot_mapping = slot_mapping.to(self.k.device)
        validate_slot_mapping(slot_mapping, k.shape[0], self.num_slots)
        self._write(layer, k, v, slot_mapping)

    def _check_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._check_layer(layer)
        expected = (self.num_kv_heads, self.head_dim)
        if k.dim() != 3 or tuple(k.shape[1:]) != expected or v.shape != k.shape:
            raise ValueError(f"k and v must be [num_tokens, {expected[0]}, {expected[1]}]; got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if self.backend == "triton":
            from radarlab.attention.triton_paged import triton_reshape_and_cache

            triton_reshape_and_cache(k, v, self.k[layer], self.v[layer], slot_mapping, check=False)
        else:
            reshape_and_cache(k, v, self.k[layer], self.v[layer], slot_mapping)

    def copy_blocks(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Copy-on-write: for each (src, dst), block dst becomes a copy of block src, in every layer.

        All sources are read before any destination is written, so the pairs act at once.
        """
        pairs = [(int(s), int(d)) for s, d in pairs]
        if not pairs:
            return
        for i, (src, dst) in enumerate(pairs):
            for name, block in (("src", src), ("dst", dst)):
                if not 0 <= block < self.num_blocks:
                    raise ValueError(f"copy_blocks pair {i}: {name} block {block} is outside the pool "
                                     f"(valid block ids: 0..{self.num_blocks - 1})")
        dsts = [d for _, d in pairs]
        if len(set(dsts)) != len(dsts):
            raise ValueError(f"copy_blocks: a destination block appears twice in {pairs}")
        src = torch.tensor([s for s, _ in pairs], device=self.k.device)
        dst = torch.tensor(dsts, device=self.k.device)
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]

    @property
    def geometry(self) -> tuple:
        """What a metadata is validated against: the pool's blocks, block size and device."""
        return (self.num_blocks, self.block_size, str(self.k.device))

    def prepare(self, meta: AttentionMetadata) -> AttentionMetadata:
        """Validate a step's metadata against this pool once, before any layer writes, and return it
        on the pool's device, stamped as checked for this pool's geometry and carrying the torch
        path's per-step plan (radarlab.attention.sdpa_paged), so the layers only attend."""
        if meta.slot_mapping is None or meta.block_tables is None:
            missing = [n for n in ("slot_mapping", "block_tables") if getattr(meta, n) is None]
            raise ValueError(f"PagedKVCache needs AttentionMetadata.{' and '.join(missing)}")
        if meta.checked_for == self.geometry:
            return meta if meta.plan is not None or self.backend != "torch" else self._with_plan(meta)
        tensors = (meta.query_start_loc, meta.seq_lens, meta.slot_mapping, meta.block_tables)
        if any(t.device != self.k.device for t in tensors):
            meta = meta.to(self.k.device)  # the model runner builds it on the device already
        validate_block_tables(meta.block_tables, meta.seq_lens, self.num_blocks, self.block_size)
        validate_slot_mapping(meta.slot_mapping, meta.num_tokens, self.num_slots)
        meta = replace(meta, checked_for=self.geometry)
        return self._with_plan(meta) if self.backend == "torch" else meta

    def _with_plan(self, meta: AttentionMetadata) -> AttentionMetadata:
        return replace(meta, plan=plan_paged_sdpa(meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                                  self.block_size))

    def attend(self, layer: int, q, k, v, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Write this step's K/V at meta.slot_mapping, then attend over meta.block_tables.

        The model runner passes metadata from prepare(), checked once per step; anything else is
        checked here, in every layer."""
        self._check_kv(layer, k, v)
        meta = self.prepare(meta)
        self._write(layer, k, v, meta.slot_mapping)
        if self.backend == "triton":
            from radarlab.attention.triton_paged import triton_paged_attention

            return triton_paged_attention(q, self.k[layer], self.v[layer], meta.block_tables, meta.seq_lens,
                                          meta.query_start_loc, scale, check=False)
        # The torch path: SDPA over gathered rows (sdpa_paged.py), equal to paged_attention_torch.
        return paged_attention_sdpa(q, self.k[layer], self.v[layer], meta.plan, scale)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is outside the cache (valid layers: 0..{self.num_layers - 1})")

    def __repr__(self) -> str:
        return (f"PagedKVCache(layers={self.num_layers}, blocks={self.num_blocks}, block_size={self.block_size}, "
                f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.k.dtype}, "
                f"backend={self.backend!r})")
