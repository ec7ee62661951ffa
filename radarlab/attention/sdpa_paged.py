"""Paged attention on the CPU, fast: torch's fused SDPA over K/V gathered token by token, in the pool's dtype.

torch_paged.py is the readable reference; this is the path the engine runs on the torch backend.
Three differences, each measured on the decode step (notebook 05):

- **A plan per step, not per layer.** Everything that depends only on the block tables and the
  lengths (which pool row every context token lives in, the masks, which rows are decodes) is
  built once per step by plan_paged_sdpa, with one host sync, and every layer reuses it. The
  reference redoes that work, and its .tolist() calls, in each of the 30 layers. vLLM's attention
  backends split their work the same way: a metadata builder per step, a kernel per layer.
- **No fp32 copy of K/V.** The K/V rows are gathered in the pool's dtype and handed to
  F.scaled_dot_product_attention, whose CPU kernel accumulates in fp32 itself. The reference
  upcasts the whole gathered batch to fp32 first. In a decode, the query heads that share a KV
  head (GQA) are that head's query rows, so no K/V is repeated; prefill chunks use enable_gqa.
- **Token rows, not padded blocks.** Decodes are batched: sequence b gathers as many rows as the
  longest context of its bucket, the ones past its own length pointing at its last real token (a
  finite value; the mask gives it zero weight, so no masked_fill over V is needed), so no row beyond
  that and no unused block is read. Prefill chunks gather exactly their seq_len rows.
- **Length buckets.** A large batch of decodes is sorted by context length and cut into a few buckets
  of similar length, one SDPA call each (one per 16 decodes, at most 4): a short sequence then pads
  to its bucket's longest context, not to the batch's. Measured on the engine's step, 2 threads, 64
  decodes at contexts 38-147, alternating runs: fp32 113 -> 102 ms, bf16 73 -> 69 ms; at 16 decodes
  buckets did not pay (26 ms either way), so they start at 32.

The gather is still a copy: SDPA needs each sequence's K/V as one strided tensor. On a CPU the
decodes therefore go, when it can be built, to a C++ kernel that reads the blocks in place
(cpu_decode.py; plan_paged_sdpa(..., decode_kernel=True)), the split vLLM's TORCH_SDPA backend made:
SDPA for prompts and chunks, its own paged kernel for decodes. The buckets are the fallback.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radarlab.attention.cpu_decode import paged_decode_cpu
from radarlab.kvcache.block_table import compute_slot_mapping

DECODES_PER_BUCKET = 16  # a bucket per this many decodes, up to max_buckets (measured: no gain at 16)
# With the C++ kernel, a sequence with at most this many queries (a speculative verify step: the last
# token and its k drafts) goes to the kernel too, as that many decode rows: query i of the chunk
# attends to the first (seq_len - n + i + 1) tokens, which is causal attention. Each row reads the
# context again, so long chunks stay on SDPA, which reads it once for all of them.
KERNEL_MAX_QUERIES = 8


@dataclass(frozen=True)
class PrefillPlan:
    """One sequence with more than one query (or none: skipped): rows lo:hi of q, context rows slots."""
    lo: int
    hi: int
    slots: torch.Tensor  # [seq_len] pool row of each context token
    mask: torch.Tensor | None  # [hi - lo, seq_len] causal mask; None when the chunk is the whole sequence


@dataclass(frozen=True)
class DecodeBucket:
    """Decodes of similar context length, attended in one SDPA call."""
    rows: torch.Tensor | None  # [n] q rows of these decodes; None: every row of the step, in order
    slots: torch.Tensor  # [n * T] pool row per (decode, context position)
    mask: torch.Tensor | None  # [n, 1, 1, T] True where position < seq_len; None: all True
    context: int  # T, the bucket's longest context


@dataclass(frozen=True)
class KernelDecodes:
    """Every decode of the step, and every query of its short chunks (KERNEL_MAX_QUERIES), for the
    C++ kernel (cpu_decode.py): no gather, no padding. A chunk's sequence has one row per query."""
    rows: torch.Tensor | None  # [n] int64 q rows of the decodes; None: every row of the step, in order
    block_tables: torch.Tensor  # [n, max_blocks] int32, contiguous
    seq_lens: torch.Tensor  # [n] int32
    context: int  # the longest of them


@dataclass(frozen=True)
class PagedSDPAPlan:
    """What every layer of one step needs to attend over the paged pool (see plan_paged_sdpa)."""
    num_tokens: int
    decodes: tuple[DecodeBucket, ...]
    prefills: tuple[PrefillPlan, ...]
    padded: bool = True  # slot_mapping may hold -1 (padding): the write must look; False: checked, none
    kernel: KernelDecodes | None = None  # the decodes, when the C++ kernel takes them (then decodes is ())

    @property
    def context(self) -> int:
        """The longest decode context of the step (0 without decodes)."""
        if self.kernel is not None:
            return self.kernel.context
        return max((b.context for b in self.decodes), default=0)


def plan_paged_sdpa(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    block_size: int, slot_mapping: torch.Tensor | None = None, max_buckets: int = 4,
                    decode_kernel: bool = False) -> PagedSDPAPlan:
    """The per-step part of paged attention. The caller has validated the block tables (layout.py):
    only entries below cdiv(seq_len, block_size) are read. With the step's slot_mapping, the plan
    also says whether any slot is padding (-1), so that no layer's KV write has to check again.
    decode_kernel: the decodes, and the chunks of at most KERNEL_MAX_QUERIES queries, go to the C++
    kernel (cpu_decode.py; CPU tensors), not to SDPA."""
    seq_lens = seq_lens.long()
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    device = block_tables.device
    is_decode = query_lens == 1
    # the step's one sync
    bounds, lens, decodes = query_start_loc.tolist(), seq_lens.tolist(), is_decode.tolist()
    padded = slot_mapping is None or bool((slot_mapping < 0).any())
    seqs = [b for b, d in enumerate(decodes) if d]
    kernel, short = None, set()
    if decode_kernel:
        short = {b for b, (lo, hi) in enumerate(zip(bounds, bounds[1:])) if 0 < hi - lo <= KERNEL_MAX_QUERIES}
        if short:
            kernel = _kernel_decodes(sorted(short), bounds, lens, block_tables, all(decodes))
        seqs = []
    num_buckets = max(1, min(max_buckets, len(seqs) // DECODES_PER_BUCKET))
    if num_buckets > 1:
        seqs.sort(key=lambda b: lens[b])
    size = -(-len(seqs) // num_buckets) if seqs else 0
    in_order = all(decodes) and num_buckets == 1  # every row a decode, one call: no gather, no scatter
    buckets = tuple(_bucket(seqs[i:i + size], lens, block_tables, query_start_loc, block_size, in_order)
                    for i in range(0, len(seqs), size)) if seqs else ()
    prefills = []
    for b, (lo, hi, seq_len, decode) in enumerate(zip(bounds, bounds[1:], lens, decodes)):
        if decode or hi == lo or b in short:
            continue
        keys = torch.arange(seq_len, device=device)[None, :]
        slots = compute_slot_mapping(block_tables[b:b + 1], keys, block_size)[0]
        mask = None
        if hi - lo != seq_len:  # a chunk: query i sits at position seq_len - (hi - lo) + i
            first = seq_len - (hi - lo)
            mask = (torch.arange(seq_len, device=device)[None, :]
                    <= first + torch.arange(hi - lo, device=device)[:, None])
        prefills.append(PrefillPlan(lo, hi, slots, mask))
    return PagedSDPAPlan(bounds[-1], buckets, tuple(prefills), padded, kernel)


def _kernel_decodes(seqs: list[int], bounds: list[int], lens: list[int], block_tables,
                    in_order: bool) -> KernelDecodes:
    """One kernel row per query of the sequences `seqs`: q row lo + i of a sequence with n queries
    attends to its first lens - n + i + 1 tokens."""
    entries = [(b, lo + i, lens[b] - (hi - lo) + i + 1) for b in seqs
               for lo, hi in [(bounds[b], bounds[b + 1])] for i in range(hi - lo)]
    index = torch.tensor([b for b, _, _ in entries], device=block_tables.device)
    tables = block_tables if in_order else block_tables[index]
    rows = None if in_order else torch.tensor([r for _, r, _ in entries], device=block_tables.device)
    return KernelDecodes(rows, tables.to(torch.int32).contiguous(),
                         torch.tensor([n for _, _, n in entries], dtype=torch.int32),
                         max(lens[b] for b in seqs))


def _bucket(seqs: list[int], lens: list[int], block_tables, query_start_loc, block_size: int,
            in_order: bool) -> DecodeBucket:
    """The decodes `seqs` (sequence indices) as one SDPA call's worth of rows."""
    device = block_tables.device
    index = torch.tensor(seqs, device=device)
    seq_lens = torch.tensor([lens[b] for b in seqs], device=device)
    context = max(lens[b] for b in seqs)
    # past its length, each sequence re-reads its last token: finite, and masked out
    positions = torch.minimum(torch.arange(context, device=device)[None, :], seq_lens[:, None] - 1)
    slots = compute_slot_mapping(block_tables[index], positions, block_size).flatten()
    mask = None
    if min(lens[b] for b in seqs) < context:
        mask = (torch.arange(context, device=device)[None, :] < seq_lens[:, None])[:, None, None, :]
    rows = None if in_order else query_start_loc[:-1].to(device)[index]
    return DecodeBucket(rows, slots, mask, context)


def paged_attention_sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: PagedSDPAPlan,
                         scale: float) -> torch.Tensor:
    """Causal attention for packed queries q [T, H, D] over one layer's pool [num_blocks, block_size,
    kv_heads, D]; the same result as paged_attention_torch (up to rounding), in q's dtype."""
    if q.shape[0] != plan.num_tokens:
        raise ValueError(f"q has {q.shape[0]} rows but the plan was made for {plan.num_tokens} tokens")
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_rows = k_cache.view(-1, num_kv_heads, head_dim)  # slot s is row s
    v_rows = v_cache.view(-1, num_kv_heads, head_dim)
    gqa = q.shape[1] != num_kv_heads
    if plan.kernel is None and len(plan.decodes) == 1 and plan.decodes[0].rows is None:
        return _decode(q, k_rows, v_rows, plan.decodes[0], scale)  # all decodes, one call, no scatter
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if plan.kernel is not None:  # the decodes' rows of out, straight from the blocks
        d = plan.kernel
        paged_decode_cpu(q, k_cache, v_cache, d.block_tables, d.seq_lens, scale, out=out, rows=d.rows,
                         check=False)
    for bucket in plan.decodes:
        out[bucket.rows] = _decode(q[bucket.rows], k_rows, v_rows, bucket, scale)
    for p in plan.prefills:
        # [1, kv_heads, seq_len, D]: a 16-bit pool under an fp32 model is read up. Four dimensions, not
        # three: with 3-D inputs torch's CPU dispatch skips its fused flash kernel for the unfused math
        # path (measured in the engine, fp32, 2 threads: a 6-token verify step at context 300, 26.8 ->
        # 24.2 ms; a 275-token prefill's attention, 30 layers, 47 -> 41 ms).
        k = k_rows.index_select(0, p.slots).transpose(0, 1).to(q.dtype)[None]
        v = v_rows.index_select(0, p.slots).transpose(0, 1).to(q.dtype)[None]
        o = F.scaled_dot_product_attention(q[p.lo:p.hi].transpose(0, 1)[None], k, v, attn_mask=p.mask,
                                           scale=scale, is_causal=p.mask is None, enable_gqa=gqa)
        out[p.lo:p.hi] = o[0].transpose(0, 1)
    return out


def _decode(q, k_rows, v_rows, bucket: DecodeBucket, scale: float) -> torch.Tensor:
    """One query per sequence, q [Bd, H, D], all sequences in one SDPA call. The G query heads that
    share a KV head go in as G query rows of that head: SDPA then reads each K/V row once for the
    whole group (measured in bf16: 4x faster than one query row per head with enable_gqa)."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = k_rows.shape[1]
    k = k_rows.index_select(0, bucket.slots).view(num_seqs, bucket.context, num_kv_heads,
                                                  head_dim).to(q.dtype)
    v = v_rows.index_select(0, bucket.slots).view(num_seqs, bucket.context, num_kv_heads,
                                                  head_dim).to(q.dtype)
    grouped = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped, k.transpose(1, 2), v.transpose(1, 2), attn_mask=bucket.mask,
                                         scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)
