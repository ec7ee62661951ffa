"""The paged KV cache: per-layer pools of fixed-size blocks, written by slot mapping, read by block table.

Instead of reserving max_len positions per sequence (contiguous.py), memory is cut into blocks of
block_size tokens. A sequence owns a list of blocks (its block table, kept by the block manager in
kv_cache_manager.py) and grows one block at a time, so at most block_size - 1 positions per sequence are
ever wasted. The pool of one layer is [num_blocks, block_size, num_kv_heads, head_dim], vLLM's flash
layout: one token's K (or V) for all heads is one contiguous row, and so is a whole block.

Two indirections, with vLLM's names:
- slot mapping (writes): new token t goes to slot = block_id * block_size + offset; -1 means
  padding and is skipped;
- block tables (reads): block_tables[b, i] is the physical block holding sequence b's positions
  i*block_size .. (i+1)*block_size - 1.

The cache does not choose blocks; the caller (the block manager, via AttentionMetadata) does. Nor
does it attend: the attention backends (radarlab.attention.backends) write and read these tensors.

Quantized caches (kv_cache_dtype, any name of radarlab.quant.formats): self.k / self.v hold the payload
(FP8 codes, or two INT4 codes a byte) in the same block layout, and self.k_scales / self.k_zeros, where
the format stores scales per token, are block-shaped beside it: [num_layers, num_blocks, block_size,
num_kv_heads, S], so the block table that finds a block's codes finds its scales. FP8's static scales
(vLLM's k_scale / v_scale) are per layer: self.k_scale [num_layers] or, calibrated per head,
[num_layers, num_kv_heads]. The write quantizes; attention reads through QuantizedPool views, which
dequantize only the blocks a step reads. A rotated format rotates K (stored) and q (before attention)
by the same orthogonal matrix, so scores are unchanged up to quantization error; with `vrot` it rotates
V too and the attention output back (o = o' R^T per head, on both backends), which leaves the output
unchanged up to quantization error. A `sink<N>` format keeps each sequence's first N tokens in 16-bit
beside the blocks (sink_store.py; torch backend). kivi_quantizer (radarlab.quant.kivi.KiviQuantizer):
a KIVI cache's key quantizer and quantized_length, radarlab's unless given; torch backend only, since
the Triton kernels build radarlab's own in.
"""
from __future__ import annotations

from typing import Iterable

import torch

from radarlab.cpu_ops import cpu_ops_available, load_cpu_ops
from radarlab.kvcache.kivi_store import KiviStore, default_tail_groups, tail_bytes
from radarlab.kvcache.sink_store import DEFAULT_SINK_SEQUENCES, SinkPool, SinkStore
from radarlab.quant.formats import KVFormat, kv_format
from radarlab.quant.kv_codec import (
    QuantizedPool,
    check_static_scale,
    meta_dtype,
    payload_width,
    scale_width,
    zero_dtype,
)
from radarlab.quant.rotation import rotation_matrix
from radarlab.util import require_int, require_power_of_two


class PagedKVCache:
    """K and V pools shaped [num_layers, num_blocks, block_size, num_kv_heads, head_dim]: storage only.

    self.k[layer] is one layer's pool. What writes and reads it is an attention backend
    (radarlab.attention.backends, chosen from this cache's settings): backend "torch" (gather the
    context's rows, then torch's fused SDPA) or "triton" (kernels that read the blocks in place).
    cpu_ops (torch backend, fp32 or 16-bit pools on a CPU): the KV write and the decodes' attention run
    as radarlab's C++ operators (radarlab.cpu_ops); None: wherever they can be built.
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
        kv_cache_dtype: str | KVFormat = "auto",
        k_scale=1.0,
        v_scale=1.0,
        num_tail_groups: int | None = None,
        num_sinks: int | None = None,
        cpu_ops: bool | None = None,
        kivi_quantizer=None,
    ) -> None:
        for name, value in [("num_layers", num_layers), ("num_blocks", num_blocks),
                            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)]:
            require_int(name, value)
        require_power_of_two("block_size", block_size)
        if backend not in self.BACKENDS:
            raise ValueError(f"backend must be one of {self.BACKENDS}, got {backend!r}")
        fmt = kv_format(kv_cache_dtype).resolve(dtype)
        fmt.check_head_dim(head_dim)
        if backend == "triton" and fmt.is_quantized:  # no padded lanes inside a group in those kernels
            require_power_of_two("head_dim (the quantized Triton kernels)", head_dim)
        self.kv_format = fmt
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.backend = backend
        self.dtype = dtype  # what attention returns; the pool itself stores fmt.storage_dtype
        lead = (num_layers, num_blocks, block_size, num_kv_heads)
        if kivi_quantizer is not None and (fmt.kind != "kivi" or backend != "torch"):
            raise ValueError(f"kivi_quantizer needs a kivi kv_cache_dtype and the torch backend (the Triton "
                             f"kernels quantize and settle groups by radarlab's rule); got {fmt.name!r} "
                             f"on backend {backend!r}")
        if fmt.kind == "kivi":  # its own layout: key scales per group of tokens, 16-bit tails (kivi_store.py)
            self.kivi = KiviStore(fmt, num_layers, num_blocks, block_size, num_kv_heads, head_dim, device,
                                  num_tail_groups, kivi_quantizer)
            self.k, self.v = self.kivi.k, self.kivi.v
            self.k_scales, self.v_scales = self.kivi.k_scales, self.kivi.v_scales
            self.k_zeros, self.v_zeros = self.kivi.k_zeros, self.kivi.v_zeros
        else:
            self.kivi = None
            self.k = torch.zeros(*lead, payload_width(fmt, head_dim), dtype=fmt.storage_dtype, device=device)
            self.v = torch.zeros_like(self.k)
            self.k_scales = self.v_scales = self.k_zeros = self.v_zeros = None
            if scale_width(fmt, head_dim):  # fp8_per_token_head, int4: scales beside the codes
                self.k_scales = torch.ones(*lead, scale_width(fmt, head_dim),
                                           dtype=meta_dtype(fmt), device=device)
                self.v_scales = torch.ones_like(self.k_scales)
                if not fmt.symmetric and fmt.is_packed:
                    self.k_zeros = torch.zeros_like(self.k_scales, dtype=zero_dtype(fmt))
                    self.v_zeros = torch.zeros_like(self.k_zeros)
        self.k_scale = self.v_scale = None
        if fmt.kind == "fp8" and fmt.scale_rule == "tensor":
            self.set_kv_scales(k_scale, v_scale)
        elif not (_is_one(k_scale) and _is_one(v_scale)):
            raise ValueError(f"k_scale and v_scale are static fp8 scales; {fmt.name} takes none (got "
                             f"{k_scale!r}, {v_scale!r})")
        self.rotation = (rotation_matrix(fmt.rotation, head_dim).to(device) if fmt.rotation else None)
        self.sinks = (SinkStore(fmt.sink, num_layers, num_blocks, block_size, num_kv_heads, head_dim, device,
                                num_sinks) if fmt.sink else None)
        self.cpu_ops = self._use_cpu_ops(cpu_ops)

    def _use_cpu_ops(self, wanted: bool | None) -> bool:
        """Whether the write and the decodes use the C++ operators: they read plain fp32/16-bit blocks
        on the CPU."""
        fits = self.backend == "torch" and not self.kv_format.is_quantized and self.k.device.type == "cpu"
        if wanted is None:
            return fits and cpu_ops_available(self.k.device)
        if wanted and not fits:
            raise ValueError(f"cpu_ops=True needs the torch backend, a CPU pool and an unquantized format; "
                             f"got backend={self.backend!r}, device={self.k.device}, "
                             f"kv_cache_dtype={self.kv_format.name!r}")
        if wanted:
            load_cpu_ops()  # CpuOpsUnavailable, with the compiler's reason, now rather than mid-step
        return bool(wanted)

    @classmethod
    def for_model(cls, config, num_blocks: int, block_size: int = 16, dtype=torch.float32, device="cpu",
                  backend: str = "torch", kv_cache_dtype: str | KVFormat = "auto", k_scale=1.0,
                  v_scale=1.0, max_num_seqs: int | None = None,
                  cpu_ops: bool | None = None, kivi_quantizer=None) -> "PagedKVCache":
        """max_num_seqs sizes what a format keeps per sequence (KIVI's tails, the sinks); None: 64."""
        fmt = kv_format(kv_cache_dtype)
        tails = default_tail_groups(fmt, max_num_seqs) if max_num_seqs and fmt.kind == "kivi" else None
        return cls(config.num_layers, num_blocks, config.num_kv_heads, config.head_dim, block_size,
                   dtype, device, backend, kv_cache_dtype, k_scale, v_scale, tails, max_num_seqs, cpu_ops,
                   kivi_quantizer)

    def set_kv_scales(self, k_scale, v_scale) -> None:
        """fp8's static scales, one per layer: a number (every layer), a tensor [num_layers], or per head
        [num_layers, num_kv_heads] (e.g. calibrated with radarlab.quant.fp8.calibrated_scale)."""
        if self.kv_format.kind != "fp8" or self.kv_format.scale_rule != "tensor":
            raise ValueError(f"{self.kv_format.name} has no static scales to set")
        self.k_scale = self._layer_scales("k_scale", k_scale)
        self.v_scale = self._layer_scales("v_scale", v_scale)

    def _layer_scales(self, name: str, scale) -> torch.Tensor:
        s = scale if isinstance(scale, torch.Tensor) else torch.full((self.num_layers,), float(scale))
        if tuple(s.shape) not in ((self.num_layers,), (self.num_layers, self.num_kv_heads)):
            raise ValueError(f"{name} must be a number, [{self.num_layers}] (per layer) or "
                             f"[{self.num_layers}, {self.num_kv_heads}] (per layer and head), "
                             f"got shape {tuple(s.shape)}")
        for layer in range(self.num_layers):
            check_static_scale(s[layer], self.num_kv_heads)  # finite and > 0, or ValueError
        return s.float().to(self.k.device)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def block_tensors(self) -> list[torch.Tensor]:
        """Every block-shaped tensor: payloads, and the scales and zero points stored beside them."""
        return [t for t in (self.k, self.v, self.k_scales, self.v_scales, self.k_zeros, self.v_zeros)
                if t is not None]

    @property
    def nbytes(self) -> int:
        """Every byte the cache holds: blocks, their scales, KIVI's 16-bit tails and the 16-bit sinks."""
        tails = self.kivi.k_tail.nbytes + self.kivi.v_tail.nbytes if self.kivi is not None else 0
        sinks = self.sinks.nbytes if self.sinks is not None else 0
        return sum(t.nbytes for t in self.block_tensors()) + tails + sinks

    @staticmethod
    def bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                        kv_cache_dtype: str | KVFormat = "auto", dtype: torch.dtype = torch.float32) -> int:
        """Bytes one block takes in all layers, K and V, scales and zero points included."""
        fmt = kv_format(kv_cache_dtype).resolve(dtype)
        payload, overhead = fmt.bytes_per_token_head(head_dim, dtype)
        total = (payload + overhead) * block_size * num_kv_heads * num_layers
        if total.denominator != 1:
            raise ValueError(f"{fmt.name}: a block of {block_size} tokens is not a whole number of bytes")
        return int(total)

    def layer_pools(self, layer: int, fresh: bool = False):
        """(K, V) of one layer as attention reads them: plain tensors, or QuantizedPool views
        (fresh: KIVI's, with this step's groups as they were before quantizing)."""
        if not self.kv_format.is_quantized:
            return self.k[layer], self.v[layer]
        pools = self.kivi.pools(layer, fresh) if fresh else self.encoded_pools(layer)
        if self.sinks is not None:
            return tuple(SinkPool(p, self.sinks, layer, keys) for p, keys in zip(pools, (True, False)))
        return pools

    def encoded_pools(self, layer: int):
        if self.kivi is not None:
            return self.kivi.pools(layer)
        pick = (lambda t: None if t is None else t[layer])
        scale = (lambda t: 1.0 if t is None else t[layer])
        return (QuantizedPool(self.kv_format, self.k[layer], pick(self.k_scales), pick(self.k_zeros),
                              scale(self.k_scale), self.head_dim),
                QuantizedPool(self.kv_format, self.v[layer], pick(self.v_scales), pick(self.v_zeros),
                              scale(self.v_scale), self.head_dim))

    def check_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """This step's k, v of one layer must be [num_tokens, kv_heads, head_dim]: ValueError if not."""
        self._check_layer(layer)
        expected = (self.num_kv_heads, self.head_dim)
        if k.dim() != 3 or tuple(k.shape[1:]) != expected or v.shape != k.shape:
            raise ValueError(f"k and v must be [num_tokens, {expected[0]}, {expected[1]}]; got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")

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
        for t in self.block_tensors():  # codes and the scales beside them move together
            t[:, dst] = t[:, src]
        if self.kivi is not None:
            self.kivi.copy_blocks(src, dst)
        if self.sinks is not None:
            self.sinks.copy_blocks(src, dst)

    @property
    def geometry(self) -> tuple:
        """What a metadata is validated against: the pool's blocks, block size and device."""
        return (self.num_blocks, self.block_size, str(self.k.device))

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is outside the cache (valid layers: 0..{self.num_layers - 1})")

    def __repr__(self) -> str:
        return (f"PagedKVCache(layers={self.num_layers}, blocks={self.num_blocks}, "
                f"block_size={self.block_size}, "
                f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.k.dtype}, "
                f"kv_cache_dtype={self.kv_format.name!r}, backend={self.backend!r})")


def _is_one(scale) -> bool:
    return not isinstance(scale, torch.Tensor) and not isinstance(scale, bool) and scale == 1.0


def num_blocks_for_budget(budget_bytes: int, num_layers: int, num_kv_heads: int,
                          head_dim: int, block_size: int,
                          kv_cache_dtype: str | KVFormat = "auto", dtype: torch.dtype = torch.float32,
                          max_num_seqs: int = DEFAULT_SINK_SEQUENCES) -> int:
    """How many blocks a byte budget holds in a format, every scale and zero point counted: the same
    bytes give an FP8 pool twice the blocks of a 16-bit one. What a format keeps per sequence (KIVI's
    16-bit tails, the sinks) for max_num_seqs sequences comes out of the budget first. At least one
    block, or ValueError."""
    budget = require_int("budget_bytes", budget_bytes)
    per = PagedKVCache.bytes_per_block(num_layers, num_kv_heads, head_dim, block_size, kv_cache_dtype, dtype)
    fmt = kv_format(kv_cache_dtype)
    if fmt.kind == "kivi":  # the 16-bit tails come out of the same budget
        budget -= tail_bytes(fmt, num_layers, num_kv_heads, head_dim, default_tail_groups(fmt, max_num_seqs))
    if fmt.sink:  # and so do the sinks, one per sequence the cache is built for
        budget -= max_num_seqs * fmt.sink_bytes_per_stream(num_layers, num_kv_heads, head_dim)
    if budget < per:
        raise ValueError(f"budget_bytes ({budget:,}) is below one block ({per:,} bytes in "
                         f"{kv_format(kv_cache_dtype).resolve(dtype).name})")
    return budget // per
