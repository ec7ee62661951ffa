"""The attention sink in 16-bit: the first N tokens of every sequence, K and V, every layer.

Most heads put a large share of their attention on a sequence's first token (the "attention sink"),
so an error in its K or V reaches every later query. Formats with the `sink<N>` option keep a 16-bit
copy of positions 0 .. N-1 beside the quantized blocks: a cost per sequence, not per token.

Positions below N (N <= block_size) live in a sequence's first block, so a sink is found by that
block's id, like everything else the block table reaches:

    k, v       float16 [num_layers, num_sinks, N, H, D]   the 16-bit copies
    sink_of    long [num_blocks]                          the sink of a first block (-1: none)

The quantized codes of those positions are written too; reads lay the sink over them. So losing a
sink costs precision, never data: when every sink is taken, one whose block this step does not read
is dropped. A block written at an offset below N by a later position (it was freed and now holds
another sequence's later tokens) drops its stale sink. Each step's plan is made when layer 0 writes.
"""
from __future__ import annotations

import torch

DEFAULT_SINK_SEQUENCES = 64  # sinks for this many sequences: the engine's default max_num_seqs


class SinkStore:
    """16-bit copies of the first `sink` positions of up to num_sinks sequences."""

    def __init__(self, sink: int, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, device, num_sinks: int | None = None) -> None:
        if not 0 < sink <= block_size:
            raise ValueError(f"sink ({sink}) must be 1 .. block_size ({block_size}): the sink lives "
                             f"in a sequence's first block")
        n = DEFAULT_SINK_SEQUENCES if num_sinks is None else num_sinks
        if n < 1:
            raise ValueError(f"num_sinks must be >= 1, got {n}")
        self.sink, self.block_size = sink, block_size
        self.k = torch.zeros(num_layers, n, sink, num_kv_heads, head_dim, dtype=torch.float16, device=device)
        self.v = torch.zeros_like(self.k)
        self.sink_of = torch.full((num_blocks,), -1, dtype=torch.long, device=device)
        self.free = list(range(n - 1, -1, -1))
        self.plan: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def begin_step(self, slot_mapping, block_tables, seq_lens, query_start_loc) -> None:
        """Which of this step's tokens go to a sink (and where); drop sinks their blocks no longer hold."""
        N, B = self.sink, self.block_size
        bounds, slots = query_start_loc.tolist(), slot_mapping.tolist()
        first_blocks = {int(b) for b in block_tables[:, 0].tolist()} if block_tables.numel() else set()
        rows, sinks, offsets = [], [], []
        for b, seq_len in enumerate(seq_lens.tolist()):
            start, end = bounds[b], bounds[b + 1]
            first_new = seq_len - (end - start)
            for i in range(start, end):
                pos, slot = first_new + i - start, slots[i]
                if slot < 0:
                    continue
                block, offset = slot // B, slot % B
                if pos >= N:
                    if offset < N and int(self.sink_of[block]) >= 0:  # a reused block: its sink is stale
                        self._release(block)
                    continue
                if pos == 0 and int(self.sink_of[block]) < 0:
                    self.sink_of[block] = self._allocate(first_blocks)
                s = int(self.sink_of[block])
                if s >= 0:  # -1: its sink was dropped; the codes serve
                    rows.append(i)
                    sinks.append(s)
                    offsets.append(pos)
        t = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.k.device)
        self.plan = (t(rows), t(sinks), t(offsets))

    def _release(self, block: int) -> None:
        self.free.append(int(self.sink_of[block]))
        self.sink_of[block] = -1

    def _allocate(self, busy: set) -> int:
        if not self.free:
            for block in (self.sink_of >= 0).nonzero().flatten().tolist():
                if block not in busy:
                    self._release(block)
                    break
            else:
                raise RuntimeError(f"all {self.k.shape[1]} sinks belong to sequences of this step; build the "
                                   f"cache with more num_sinks")
        return self.free.pop()

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """This step's k, v [T, H, D]: the rows the plan names go to their sinks, in 16-bit."""
        if self.plan is None:
            raise RuntimeError("sink: write before begin_step (layer 0 plans each step)")
        rows, sinks, offsets = self.plan
        if rows.numel():
            self.k[layer, sinks, offsets] = k[rows].to(torch.float16)
            self.v[layer, sinks, offsets] = v[rows].to(torch.float16)

    def overlay(self, layer: int, blocks, x: torch.Tensor, keys: bool) -> torch.Tensor:
        """x = pool[blocks] ([..., B, H, D], float32) with every sink laid over its block's first rows."""
        which = self.sink_of[blocks]  # [...]
        if not bool((which >= 0).any()):
            return x
        store = self.k if keys else self.v
        sinks = store[layer, which.clamp(min=0)].float()  # [..., N, H, D]
        head = torch.where((which >= 0)[..., None, None, None], sinks, x[..., :self.sink, :, :])
        return torch.cat((head, x[..., self.sink:, :, :]), dim=-3)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy-on-write: dst gets its own copy of src's sink (or loses its own)."""
        for s, d in zip(src.tolist(), dst.tolist()):
            if int(self.sink_of[d]) >= 0:
                self._release(d)
            if int(self.sink_of[s]) >= 0:
                new = self._allocate(set())
                self.k[:, new], self.v[:, new] = self.k[:, self.sink_of[s]], self.v[:, self.sink_of[s]]
                self.sink_of[d] = new


class SinkPool:
    """A pool read through its sink: pool[blocks] is the inner pool's blocks with the sinks laid over."""

    def __init__(self, inner, store: SinkStore, layer: int, keys: bool) -> None:
        self.inner, self.store, self.layer, self.keys = inner, store, layer, keys
        self.shape, self.device, self.dtype = inner.shape, inner.device, torch.float32

    def dim(self) -> int:
        return 4

    def __getitem__(self, blocks) -> torch.Tensor:
        return self.store.overlay(self.layer, blocks, self.inner[blocks].float(), self.keys)
