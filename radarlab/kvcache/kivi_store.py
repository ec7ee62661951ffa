"""KIVI in the paged cache: 4-bit keys per channel over groups of g tokens, 4-bit values per token, and
the newest tokens in 16-bit, all reachable through the block table.

Layout, per layer (g divides block_size; NG = block_size / g key groups per block):

    k          uint8 [N, B, H, D/2]     key codes, packed along head_dim (a token's key is one row)
    k_scales   [N, NG, H, D]            one scale and zero point per channel per group of g tokens
    k_zeros    [N, NG, H, D]
    v          uint8 [N, B, H, D/2]     value codes, asymmetric int4 in groups of g along head_dim
    v_scales   [N, B, H, D/g], v_zeros  (as int4)
    k_tail     float16 [T, g, H, D]     16-bit tails: a key group not yet quantized, and its values
    v_tail     float16 [T, g, H, D]

All but the tails are indexed by block id, so the block table finds codes and scales alike.

The residual window lives in the tails. A group of g positions of a sequence is quantized once
positions up to quantized_length(seq_len, g, residual) cover it (radarlab.quant.kivi): it is complete,
and `residual` newer tokens follow it. Until then it sits in a tail: tail_of[block, group] names its
tail (-1: quantized). So a sequence holds at most cdiv(residual, g) + 1 tails, whatever its length,
and with residual 0 only its last, partial group is 16-bit.

A step that brings several tokens of one sequence (a prefill chunk, a verify step) would otherwise let
a query read keys its own decode step would still have held in 16-bit: the groups a later token of
the same step completes. So each write also keeps, for that layer, the 16-bit values of every group
the step touches (`fresh_pools`), and attention gives query t the quantized codes only of positions
below quantized_length(t + 1), the 16-bit values beyond (radarlab.attention.reference.
attention_settled). A prefill then sees exactly what decoding its tokens one by one would have seen,
and perplexity measured in one prefill is the perplexity of generation.

Each step's plan is made once, before layer 0 (the attention backend's build, once per step): which
groups the step touches, which tail each reads from, which are quantized now and which keep (or get)
a tail. Tails come from a free list; a group whose first position is written afresh reuses the tail a
previous owner of the block left. When the list runs dry, a tail no sequence of this step touches is
quantized early (its group as far as it is filled) and freed: it costs precision, never data.

How keys and values become codes and back, and how many tokens are quantized, are the functions of a
KiviQuantizer (radarlab.quant.kivi), radarlab's unless given: a learner's run here as they are.
"""
from __future__ import annotations

import torch

from radarlab.kvcache.block_table import group_slots
from radarlab.quant import int4, kivi
from radarlab.quant.formats import KVFormat
from radarlab.quant.kv_codec import meta_dtype, zero_dtype
from radarlab.util import cdiv

DEFAULT_TAIL_SEQUENCES = 64  # tails for this many sequences' windows: the engine's default max_num_seqs


def default_tail_groups(fmt: KVFormat, num_seqs: int = DEFAULT_TAIL_SEQUENCES) -> int:
    """Tails for num_seqs sequences: each holds its window and one partial group."""
    return num_seqs * (cdiv(fmt.residual, fmt.group_size) + 1)


def tail_bytes(fmt: KVFormat, num_layers: int, num_kv_heads: int, head_dim: int,
               num_tail_groups: int | None = None) -> int:
    """Bytes of the 16-bit tails, K and V, all layers: a fixed cost beside the blocks."""
    n = default_tail_groups(fmt) if num_tail_groups is None else num_tail_groups
    return num_layers * n * fmt.group_size * num_kv_heads * head_dim * 2 * 2


class KiviStore:
    """Every tensor and the tail bookkeeping of a KIVI-format PagedKVCache."""

    def __init__(self, fmt: KVFormat, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, device, num_tail_groups: int | None = None,
                 quantizer: kivi.KiviQuantizer | None = None) -> None:
        g = fmt.group_size
        if block_size % g:
            raise ValueError(f"kivi groups of {g} tokens must divide block_size ({block_size}): a key group "
                             f"never straddles two blocks")
        self.fmt, self.group, self.block_size = fmt, g, block_size
        self.num_groups = block_size // g
        L, N, B, H, D = num_layers, num_blocks, block_size, num_kv_heads, head_dim
        md = meta_dtype(fmt)
        self.k = torch.zeros(L, N, B, H, D // 2, dtype=torch.uint8, device=device)
        self.v = torch.zeros_like(self.k)
        self.k_scales = torch.ones(L, N, self.num_groups, H, D, dtype=md, device=device)
        self.k_zeros = torch.zeros_like(self.k_scales, dtype=zero_dtype(fmt))
        self.v_scales = torch.ones(L, N, B, H, D // g, dtype=md, device=device)
        self.v_zeros = torch.zeros_like(self.v_scales, dtype=zero_dtype(fmt))
        if num_tail_groups is None:
            num_tail_groups = default_tail_groups(fmt)
        self.k_tail = torch.zeros(L, num_tail_groups, g, H, D, dtype=torch.float16, device=device)
        self.v_tail = torch.zeros_like(self.k_tail)
        self.tail_of = torch.full((N, self.num_groups), -1, dtype=torch.long)
        self.tail_len = [0] * num_tail_groups
        self.free = list(range(num_tail_groups - 1, -1, -1))
        self.plan: dict | None = None
        self.quantize_groups = None  # the step's group-write kernel (begin_step); None: the torch code
        self.fresh: tuple | None = None  # (layer, k [n, g, H, D], v): the last write's groups in 16-bit
        self.codec = (quantizer or kivi.KiviQuantizer()).resolved(fmt.scale_dtype, fmt.int8_zeros)
        if quantizer is not None:
            self._check_quantizer(H, D)

    def _check_quantizer(self, H: int, D: int) -> None:
        """One call of each given function on a probe, so a wrong shape or dtype fails here, by name,
        rather than deep inside a forward pass."""
        g, R = self.group, self.fmt.residual
        for t in range(4 * g + R + 1):
            n = self.quantized_length(t, g, R)
            if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= t or n % g:
                raise ValueError(f"kivi_quantizer.quantized_length({t}, {g}, {R}) returned {n!r}: expected "
                                 f"an int from 0 to {t}, a multiple of the group size {g}")
        probe = torch.randn(2 * g, H, D, generator=torch.Generator().manual_seed(0)).to(self.k.device)
        c = self.codec
        for keys, fn in ((True, c.quantize_keys), (False, c.quantize_values)):
            what = f"kivi_quantizer.quantize_{'keys' if keys else 'values'}(x [{2 * g}, {H}, {D}], {g})"
            out = fn(probe, g)
            if not isinstance(out, (tuple, list)) or len(out) != 3:
                raise ValueError(f"{what} must return (codes, scales, zeros), got {type(out).__name__}")
            meta = (2, H, D) if keys else (2 * g, H, D // g)
            scales, zeros = (self.k_scales, self.k_zeros) if keys else (self.v_scales, self.v_zeros)
            want = [("codes", (2 * g, H, D), torch.uint8), ("scales", meta, scales.dtype),
                    ("zeros", meta, zeros.dtype)]
            for (label, shape, dtype), x in zip(want, out):
                tensor = isinstance(x, torch.Tensor)
                if not tensor or (tuple(x.shape), x.dtype) != (shape, dtype):
                    got = f"{x.dtype} of shape {tuple(x.shape)}" if tensor else type(x).__name__
                    raise ValueError(f"{what}: {label} must be {dtype} of shape {shape} ({self.fmt.name} "
                                     f"stores them so), got {got}")
            if bool((out[0] > 15).any()):
                raise ValueError(f"{what}: codes must be 4-bit (0..15), got {int(out[0].max())}")
            back = (c.dequantize_keys if keys else c.dequantize_values)(*out, g)
            name = f"kivi_quantizer.dequantize_{'keys' if keys else 'values'}"
            if not isinstance(back, torch.Tensor) or tuple(back.shape) != tuple(probe.shape) \
                    or not back.is_floating_point():
                got = f"{back.dtype} of shape {tuple(back.shape)}" if isinstance(back, torch.Tensor) else \
                    type(back).__name__
                raise ValueError(f"{name}(codes, scales, zeros, {g}) must return floats of shape "
                                 f"{tuple(probe.shape)}, got {got}")
            if not bool(torch.isfinite(back).all()):
                raise ValueError(f"{name} returned values that are not finite, from codes of finite keys")

    @property
    def quantized_length(self):
        """The codec's rule of how many of a sequence's tokens are quantized (attention reads by it too)."""
        return self.codec.quantized_length

    def block_tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v, self.k_scales, self.v_scales, self.k_zeros, self.v_zeros]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.block_tensors()) + self.k_tail.nbytes + self.v_tail.nbytes

    @property
    def num_free_tails(self) -> int:
        return len(self.free)

    # --- the plan of a step ---------------------------------------------------------------------
    def begin_step(self, slot_mapping, block_tables, seq_lens, query_start_loc, quantize_groups=None) -> None:
        """Decide, once per step, what every touched group reads, and where it goes. quantize_groups:
        the attention backend's kernel for a group write (the Triton one), None for the torch code
        here; the step's writes and early evictions use it."""
        self.quantize_groups = quantize_groups
        g, B, R = self.group, self.block_size, self.fmt.residual
        tables = block_tables.tolist()
        bounds = query_start_loc.tolist()
        items: dict[tuple[int, int], list] = {}  # (block, group) -> [src, keep, valid]
        skip: dict[tuple[int, int], int] = {}  # rows left out of the group's range: the sink, kept in 16-bit
        for b, seq_len in enumerate(seq_lens.tolist()):
            first_new = seq_len - (bounds[b + 1] - bounds[b])
            done_before = self.quantized_length(first_new, g, R)
            quantized = self.quantized_length(seq_len, g, R)
            for j in range(done_before // g, cdiv(seq_len, g)):
                start = j * g
                block, gib = tables[b][start // B], (start % B) // g
                old = start < first_new  # the group holds tokens of earlier steps
                tail = int(self.tail_of[block, gib])
                keep = start + g > quantized
                new = start + g > first_new
                if not new and (keep or tail < 0):
                    continue  # unchanged: still in its tail, or already quantized
                src = tail if old and tail >= 0 else (-2 if old else -1)  # -2: decode from the codes
                items[(block, gib)] = [src, keep, min(g, seq_len - start)]
                skip[(block, gib)] = self.fmt.sink if start == 0 else 0
        for (block, gib), item in items.items():  # tails: release, reuse, allocate
            src, keep, _ = item
            stale = int(self.tail_of[block, gib])
            if keep:
                dst = stale if stale >= 0 else self._allocate(items)
                item.append(dst)
                self.tail_of[block, gib] = dst
                self.tail_len[dst] = item[2]
            else:
                item.append(-1)
                if stale >= 0:
                    self.free.append(stale)
                    self.tail_of[block, gib] = -1
        keys = list(items)
        index = {key: i for i, key in enumerate(keys)}
        slots = slot_mapping.tolist()
        rows = [(i, index[(s // B, (s % B) // g)], s % g) for i, s in enumerate(slots) if s >= 0]
        t = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.k.device)
        fresh_of = torch.full(self.tail_of.shape, -1, dtype=torch.long,
                              device=self.k.device)  # -> step's item
        if keys:
            fresh_of[t([k[0] for k in keys]), t([k[1] for k in keys])] = torch.arange(len(keys),
                                                                                      device=self.k.device)
        src, dst = [items[k][0] for k in keys], [items[k][3] for k in keys]
        # Which items read a tail or old codes, and which keep a tail, as index lists made here: the
        # layers' writes then branch on their lengths, never on a device tensor (no host sync).
        from_tail = [i for i, x in enumerate(src) if x >= 0]
        keep = [i for i, x in enumerate(dst) if x >= 0]
        self.fresh = None
        self.plan = dict(fresh_of=fresh_of,
                         tail_of=self.tail_of.to(self.k.device),  # on the device, once a step
            blocks=t([k[0] for k in keys]), groups=t([k[1] for k in keys]),
            valid=t([items[k][2] for k in keys]), skip=t([skip[k] for k in keys]),
            token=t([r[0] for r in rows]), item=t([r[1] for r in rows]), offset=t([r[2] for r in rows]),
            from_tail=t(from_tail), tail_src=t([src[i] for i in from_tail]),
            from_codes=t([i for i, x in enumerate(src) if x == -2]),
            keep=t(keep), keep_dst=t([dst[i] for i in keep]),
            quantize=t([i for i, x in enumerate(dst) if x < 0]),
        )

    def _allocate(self, busy: dict) -> int:
        if not self.free:
            self._evict(busy)
        return self.free.pop()

    def _evict(self, busy: dict) -> None:
        """Quantize, in every layer, the first tail whose group this step does not touch, and free it."""
        for block, gib in (self.tail_of >= 0).nonzero().tolist():
            if (block, gib) in busy:
                continue
            tail = int(self.tail_of[block, gib])
            t = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.k.device)
            for layer in range(self.k.shape[0]):
                k, v = self.k_tail[layer, tail][None].float(), self.v_tail[layer, tail][None].float()
                self._quantize_groups(layer, k, v, t([block]), t([gib]), t([self.tail_len[tail]]))
            self.tail_of[block, gib] = -1
            self.free.append(tail)
            return
        raise RuntimeError(f"kivi: all {self.k_tail.shape[1]} tails are in use by this step's groups; build "
                           f"the cache with more num_tail_groups")

    # --- writes ---------------------------------------------------------------------------------
    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """This step's k, v [T, H, D] (rows in slot_mapping's order) into their groups, by the plan."""
        p = self.plan
        if p is None:
            raise RuntimeError("kivi: write before begin_step (the attention backend's build plans each "
                               "step)")
        n, (H, D) = p["blocks"].numel(), k.shape[1:]
        if n == 0:
            self.fresh = (layer, k.new_zeros(0, self.group, H, D).half(),
                          k.new_zeros(0, self.group, H, D).half())
            return
        ks = torch.zeros(n, self.group, H, D, device=k.device)
        vs = torch.zeros_like(ks)
        if p["from_tail"].numel():
            ks[p["from_tail"]] = self.k_tail[layer, p["tail_src"]].float()
            vs[p["from_tail"]] = self.v_tail[layer, p["tail_src"]].float()
        if p["from_codes"].numel():
            rows = p["from_codes"]
            ks[rows], vs[rows] = self._decode_groups(layer, p["blocks"][rows], p["groups"][rows])
        # Rounded to 16 bits first, as a token that waited in a tail would be: the same codes either way.
        ks[p["item"], p["offset"]] = k[p["token"]].half().float()
        vs[p["item"], p["offset"]] = v[p["token"]].half().float()
        self.fresh = (layer, ks.half(), vs.half())
        if p["keep"].numel():
            self.k_tail[layer, p["keep_dst"]] = ks[p["keep"]].half()
            self.v_tail[layer, p["keep_dst"]] = vs[p["keep"]].half()
        rows = p["quantize"]
        if rows.numel():
            self._quantize_groups(layer, ks[rows], vs[rows], p["blocks"][rows],
                                  p["groups"][rows], p["valid"][rows],
                                  p["skip"][rows])

    def _rows(self, blocks, groups) -> torch.Tensor:
        """Slots [n, g] of each group's positions."""
        return group_slots(blocks, groups, self.group, self.block_size)

    def _quantize_groups(self, layer, ks, vs, blocks, groups, valid, skip=None) -> None:
        """Groups [n, g, H, D] to codes; rows past `valid` repeat a row that counts, so they leave min and
        max unchanged. Keys also leave out their first `skip` rows (a sink, kept in 16-bit by the cache),
        whose codes are then clipped to the rest's range; values are per token and need no such care."""
        g, (n, _, H, D) = self.group, ks.shape
        rows = torch.arange(g, device=ks.device)[None, :]
        first = torch.zeros_like(valid) if skip is None else torch.where(valid > skip, skip, 0)

        def fill(x, first):
            use = (rows >= first[:, None]) & (rows < valid[:, None])
            pick = torch.where(use, rows, first[:, None])
            return torch.gather(x, 1, pick[:, :, None, None].expand_as(x))

        ks, vs = fill(ks, first), fill(vs, torch.zeros_like(valid))
        if self.quantize_groups is not None:  # the attention backend's kernel (the Triton one)
            return self.quantize_groups(ks, vs, blocks, groups, self.k[layer], self.k_scales[layer],
                                        self.k_zeros[layer], self.v[layer], self.v_scales[layer],
                                        self.v_zeros[layer], self.fmt, self.block_size)
        codes, scales, zeros = self.codec.quantize_keys(ks.reshape(n * g, H, D), g)
        slots = self._rows(blocks, groups).reshape(-1)
        self.k[layer].view(-1, H, D // 2)[slots] = int4.pack(codes)
        self.k_scales[layer][blocks, groups] = scales
        self.k_zeros[layer][blocks, groups] = zeros
        codes, scales, zeros = self.codec.quantize_values(vs.reshape(n * g, H, D), g)
        self.v[layer].view(-1, H, D // 2)[slots] = int4.pack(codes)
        self.v_scales[layer].view(-1, H, D // g)[slots] = scales
        self.v_zeros[layer].view(-1, H, D // g)[slots] = zeros

    def _decode_groups(self, layer, blocks, groups):
        slots = self._rows(blocks, groups).reshape(-1)
        H, D = self.k.shape[3], self.k.shape[4] * 2
        k = self.decode(True, self.k[layer].view(-1, H, D // 2)[slots], self.k_scales[layer][blocks, groups],
                        self.k_zeros[layer][blocks, groups])
        v = self.decode(False, self.v[layer].view(-1, H, D // 2)[slots],
                        self.v_scales[layer].view(-1, H, D // self.group)[slots],
                        self.v_zeros[layer].view(-1, H, D // self.group)[slots])
        return k.view(-1, self.group, H, D), v.view(-1, self.group, H, D)

    def decode(self, keys: bool, packed, scales, zeros) -> torch.Tensor:
        """Stored codes [..., T, H, D/2] with their scales and zeros back to float32 [..., T, H, D], through
        the codec's dequantizer, which takes [T, H, D]: leading axes (blocks) are folded into T."""
        codes = int4.unpack(packed)
        fold = lambda x: x.reshape(-1, *x.shape[-2:])
        fn = self.codec.dequantize_keys if keys else self.codec.dequantize_values
        return fn(fold(codes), fold(scales), fold(zeros), self.group).float().reshape(codes.shape)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy-on-write of codes and scales (by the caller, with every block tensor) plus the tails."""
        for s, d in zip(src.tolist(), dst.tolist()):
            for gib in range(self.num_groups):
                old = int(self.tail_of[d, gib])
                if old >= 0:
                    self.free.append(old)
                    self.tail_of[d, gib] = -1
                tail = int(self.tail_of[s, gib])
                if tail >= 0:
                    new = self._allocate({})
                    self.k_tail[:, new] = self.k_tail[:, tail]
                    self.v_tail[:, new] = self.v_tail[:, tail]
                    self.tail_len[new] = self.tail_len[tail]
                    self.tail_of[d, gib] = new

    def pools(self, layer: int, fresh: bool = False) -> tuple["KiviPool", "KiviPool"]:
        """K and V of one layer as stored; fresh=True: with this step's groups in their 16-bit values."""
        if fresh and (self.fresh is None or self.fresh[0] != layer):
            raise RuntimeError(f"kivi: no write of layer {layer} in this step to read 16-bit values from")
        return KiviPool(self, layer, keys=True, fresh=fresh), KiviPool(self, layer, keys=False, fresh=fresh)


class KiviPool:
    """One layer's K or V of a KiviStore, read as [num_blocks, block_size, H, D]: pool[blocks] decodes
    only those blocks, then lays the 16-bit tails over the groups that have one (fresh: and this
    step's groups, in the 16-bit values they had before quantizing)."""

    def __init__(self, store: KiviStore, layer: int, keys: bool, fresh: bool = False) -> None:
        self.store, self.layer, self.keys, self.fresh = store, layer, keys, fresh
        payload = store.k[layer] if keys else store.v[layer]
        self.shape = torch.Size((*payload.shape[:3], payload.shape[3] * 2))
        self.device = payload.device
        self.dtype = torch.float32

    def dim(self) -> int:
        return 4

    def __getitem__(self, blocks) -> torch.Tensor:
        s, L, g = self.store, self.layer, self.store.group
        if self.keys:
            x = s.decode(True, s.k[L][blocks], s.k_scales[L][blocks], s.k_zeros[L][blocks])
            tail = s.k_tail[L]
        else:
            x = s.decode(False, s.v[L][blocks], s.v_scales[L][blocks], s.v_zeros[L][blocks])
            tail = s.v_tail[L]
        x = _overlay(x, s.tail_of.to(x.device)[blocks], tail, g)
        if self.fresh:
            x = _overlay(x, s.plan["fresh_of"].to(x.device)[blocks], s.fresh[1 if self.keys else 2], g)
        return x


def _overlay(x: torch.Tensor, which: torch.Tensor, groups: torch.Tensor, g: int) -> torch.Tensor:
    """x [..., B, H, D] with group i of each block replaced by groups[which[..., i]] where which >= 0."""
    if not bool((which >= 0).any()):
        return x
    over = groups[which.clamp(min=0)].float().flatten(-4, -3)  # [..., B, H, D]
    has = (which >= 0).repeat_interleave(g, dim=-1)[..., None, None]
    return torch.where(has, over, x)
