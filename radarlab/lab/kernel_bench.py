"""Inputs and measurements for the paged-attention kernels: random paged batches, what a decode step
must move, the decode bandwidth sweep, and the GPU check of every kernel against its torch reference.

Decode is memory-bound: per context token and KV head it reads 2 x head_dim values (K and V) and does
4 x group x head_dim FLOPs with them (q.k and p.v for each of the group's query heads), about
2 x group / bytes_per_value FLOP per byte. A GPU's ridge point is in the hundreds, so the time of a
decode kernel is set by bytes / bandwidth, and its yardstick is achieved bandwidth: the bytes it must
move divided by its time, next to the memory's peak (a bandwidth roofline).

random_paged_batch builds inputs the way the tests do: each sequence's K/V scattered through a
shuffled block table into a pool whose unused slots hold NaN, so a kernel that reads a slot it should
not returns NaN instead of a plausible number.

Timing is radarlab.lab.measure's time_ms (do_bench on CUDA). `python -m radarlab.lab.kernel_bench`
runs check_kernels and prints its table; scripts/gpu_check.sh calls it on a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from radarlab.attention.reference import attention_reference
from radarlab.attention.torch_paged import paged_decode_torch
from radarlab.kvcache.block_table import compute_slot_mapping
from radarlab.lab.measure import gbps, time_ms
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

    def slot_mapping(self) -> torch.Tensor:
        """Where each query token's K/V lives in the pool (vLLM's slot_mapping for this step's new
        tokens): the last query_lens[b] positions of sequence b, [T] int64."""
        slots = []
        for b, (seq_len, n) in enumerate(zip(self.seq_lens.tolist(), self.query_lens)):
            pos = torch.arange(seq_len - n, seq_len, device=self.block_tables.device)
            slots.append(self.block_tables[b, pos // self.block_size].long() * self.block_size
                         + pos % self.block_size)
        return torch.cat(slots)

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
            raise ValueError(f"sequence {b}: need seq_len >= 1 and 0 <= query_len "
                             f"<= seq_len, got {s} and {n}")
    require_power_of_two("block_size", block_size)
    _check_decode_shape(seq_lens, num_heads, num_kv_heads, head_dim)

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
        slots = compute_slot_mapping(blocks[None], pos[None], block_size)[0]
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
        return gbps(self.nbytes, self.triton_ms)

    @property
    def torch_gbps(self) -> float:
        return gbps(self.nbytes, self.torch_ms)


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
        b = args = out = None  # freed before the next context (not del: the lambdas above read args, out)
        if str(device).startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------------------------------
# The GPU check: every Triton kernel against its torch reference, then timed (scripts/gpu_check.sh)

KERNELS = ("store_kv", "decode", "decode_split", "prefill")


def tolerance(dtype: torch.dtype) -> float:
    """Largest accepted |Triton - reference| for an attention output stored as dtype: 4 ulps at 1.0
    (the kernels compute in fp32 and round once at the end), and at least 1e-4 for fp32, whose sums
    over thousands of context tokens may run in another order than the reference's."""
    return max(1e-4, 4 * torch.finfo(dtype).eps)


@dataclass(frozen=True)
class KernelCheck:
    """One Triton kernel against its torch counterpart on one shape: do they agree, and how fast is each."""

    kernel: str  # one of KERNELS
    dtype: str
    batch: int
    context: int  # tokens per sequence, new ones included
    query_len: int  # new tokens per sequence
    max_error: float  # Triton against the reference (inf where one side is NaN and the other not)
    tolerance: float
    triton_ms: float
    torch_ms: float
    nbytes: int | None = None  # decode kernels only: decode_bytes, the yardstick of a memory-bound kernel
    unsplit_ms: float | None = None  # decode_split only: triton_paged_decode on the same inputs

    @property
    def matches(self) -> bool:
        return self.max_error <= self.tolerance

    @property
    def speedup(self) -> float:
        return self.torch_ms / self.triton_ms

    @property
    def vs_unsplit(self) -> float | None:
        """How many times faster split-KV decode runs than the one-program-per-(sequence, KV head) kernel."""
        return None if self.unsplit_ms is None else self.unsplit_ms / self.triton_ms

    @property
    def triton_gbps(self) -> float | None:
        return None if self.nbytes is None else gbps(self.nbytes, self.triton_ms)


def _max_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    """max |out - expected|; NaN in the same place on both sides agrees, NaN on one side is inf."""
    diff = (out.float() - expected.float()).abs()
    diff[out.isnan() & expected.isnan()] = 0.0
    return float(diff.nan_to_num(nan=float("inf")).max()) if diff.numel() else 0.0


def _check_store_kv(b: PagedBatch, device) -> tuple[float, float, float]:
    """triton_reshape_and_cache against the torch write, on two copies of one pool: the pools after
    the write must be identical (a copy has no rounding). The new K/V go to the query tokens' slots."""
    from radarlab.attention.kv_write import reshape_and_cache
    from radarlab.attention.triton_paged import triton_reshape_and_cache

    slots = b.slot_mapping()
    gen = torch.Generator(device=device).manual_seed(1)
    shape = (slots.numel(), *b.k_cache.shape[2:])
    k = torch.randn(shape, generator=gen, device=device).to(b.k_cache.dtype)
    v = torch.randn(shape, generator=gen, device=device).to(b.k_cache.dtype)
    pools = {name: (b.k_cache.clone(), b.v_cache.clone()) for name in ("triton", "torch")}
    triton_reshape_and_cache(k, v, *pools["triton"], slots)
    reshape_and_cache(k, v, *pools["torch"], slots)
    error = max(_max_error(a, r) for a, r in zip(pools["triton"], pools["torch"]))
    triton_ms = time_ms(lambda: triton_reshape_and_cache(k, v, *pools["triton"], slots, check=False), device)
    torch_ms = time_ms(lambda: reshape_and_cache(k, v, *pools["torch"], slots), device)
    return error, triton_ms, torch_ms


def _check_prefill(b: PagedBatch, device) -> tuple[float, float, float]:
    """triton_paged_prefill against the fp32 reference; timed against the torch gather path."""
    from radarlab.attention.torch_paged import paged_attention_torch
    from radarlab.attention.triton_paged import triton_paged_prefill

    args = (b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, b.scale)
    out = triton_paged_prefill(*args)
    error = _max_error(out, b.reference())
    triton_ms = time_ms(lambda: triton_paged_prefill(*args, out=out, check=False), device)
    torch_ms = time_ms(lambda: paged_attention_torch(*args, check=False), device)
    return error, triton_ms, torch_ms


def _best_ms(run, tiles: Sequence[int], device) -> float:
    """The fastest time of run(tile) over the tile sizes."""
    return min(time_ms(lambda: run(tile), device) for tile in tiles)


def _check_decode_split(b: PagedBatch, device, tiles: Sequence[int],
                        partition_size: int) -> tuple[float, float, float, float]:
    """triton_paged_decode_split against the fp32 reference and split_kv_decode_torch (the larger
    error counts); timed (best of `tiles`) against paged_decode_torch and against the unsplit
    triton_paged_decode, which reads the same bytes with fewer programs."""
    from radarlab.attention.torch_paged import split_kv_decode_torch
    from radarlab.attention.triton_paged import triton_paged_decode, triton_paged_decode_split

    args = (b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.scale)
    out = triton_paged_decode_split(*args, partition_size=partition_size)
    error = max(_max_error(out, b.reference()),
                _max_error(out, split_kv_decode_torch(*args, partition_size=partition_size)))
    max_seq_len = int(b.seq_lens.max())  # read once here, so the timed calls do not sync
    split_ms = _best_ms(lambda tile: triton_paged_decode_split(*args, partition_size=partition_size, out=out,
                                                               tile_n=tile, max_seq_len=max_seq_len,
                                                               check=False),
                        tiles, device)
    unsplit_ms = _best_ms(lambda tile: triton_paged_decode(*args, out=out, tile_n=tile, check=False), tiles,
                          device)
    torch_ms = time_ms(lambda: paged_decode_torch(*args, check=False), device)
    return error, split_ms, torch_ms, unsplit_ms


def check_kernels(shapes: Sequence[tuple[int, int]] = ((8, 512), (32, 2048), (32, 8192), (128, 2048),
                                                       (4, 16384)),
                  dtypes: Sequence[torch.dtype] = (torch.bfloat16, torch.float32),
                  kernels: Sequence[str] = KERNELS, num_heads: int = 9, num_kv_heads: int = 3,
                  head_dim: int = 64,
                  block_size: int = 16, prefill_tokens: int = 512, device: str | torch.device = "cuda",
                  tiles: Sequence[int] = (16, 32, 64), seed: int = 0,
                  partition_size: int = 512) -> list[KernelCheck]:
    """Each kernel of triton_paged.py against its torch counterpart, for each (batch, context) shape.

    store_kv writes one new token per sequence (a decode step's write) and must match the torch write
    exactly; decode (measure_decode_bandwidth, best of `tiles`), decode_split (split-KV in partitions
    of partition_size tokens, also timed beside decode: few long sequences such as 4 x 16384 are
    where it should win) and prefill (the last min(prefill_tokens, context) tokens of each sequence,
    a chunked prefill when that is less than the context) must match the fp32 reference within
    tolerance(dtype). Every correctness call runs with the argument checks on; the timed calls skip
    them. The defaults are the course model's heads at GPU sizes.
    """
    unknown = [k for k in kernels if k not in KERNELS]
    if unknown:
        raise ValueError(f"kernels must be among {KERNELS}, got {list(kernels)}")
    require_int("prefill_tokens", prefill_tokens)
    if "decode_split" in kernels:
        from radarlab.attention.layout import validate_partition_size

        validate_partition_size(partition_size, block_size)
    rows = []
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        for batch, context in shapes:
            batch, context = require_int("batch", batch), require_int("context", context)
            for kernel in kernels:
                query_len = min(prefill_tokens, context) if kernel == "prefill" else 1
                if kernel == "decode":
                    d = measure_decode_bandwidth([context], batch, num_heads, num_kv_heads, head_dim,
                                                 block_size, dtype, device, tiles, seed)[0]
                    rows.append(KernelCheck(kernel, name, batch, context, 1, d.max_error, tolerance(dtype),
                                            d.triton_ms, d.torch_ms, d.nbytes))
                    continue
                b = random_paged_batch([context] * batch, [query_len] * batch, block_size, num_heads,
                                       num_kv_heads, head_dim, seed=seed, device=device, dtype=dtype)
                if kernel == "decode_split":
                    error, triton_ms, torch_ms, unsplit_ms = _check_decode_split(b, device, tiles,
                                                                                 partition_size)
                    nbytes = decode_bytes([context] * batch, num_heads, num_kv_heads, head_dim, block_size,
                                          b.k_cache.element_size(), b.block_tables.element_size())
                    rows.append(KernelCheck(kernel, name, batch, context, 1, error, tolerance(dtype),
                                            triton_ms, torch_ms, nbytes, unsplit_ms))
                else:
                    check = _check_store_kv if kernel == "store_kv" else _check_prefill
                    error, triton_ms, torch_ms = check(b, device)
                    rows.append(KernelCheck(kernel, name, batch, context, query_len, error,
                                            0.0 if kernel == "store_kv" else tolerance(dtype), triton_ms,
                                            torch_ms))
                del b
                if str(device).startswith("cuda"):
                    torch.cuda.empty_cache()
    return rows


def format_kernel_checks(rows: Sequence[KernelCheck]) -> str:
    """The table gpu_check.sh prints: agreement first, then the times."""
    lines = [f"{'kernel':>12} {'dtype':>8} {'batch':>5} {'context':>7} {'new':>5} {'max err':>8} {'tol':>7} "
             f"{'match':>5} {'triton ms':>9} {'torch ms':>9} {'speedup':>7} "
             f"{'triton GB/s':>11} {'vs decode':>9}"]
    for r in rows:
        gbps = f"{r.triton_gbps:>11.0f}" if r.triton_gbps is not None else f"{'-':>11}"
        vs = f"{r.vs_unsplit:>8.2f}x" if r.vs_unsplit is not None else f"{'-':>9}"
        lines.append(f"{r.kernel:>12} {r.dtype:>8} {r.batch:>5} {r.context:>7} "
                     f"{r.query_len:>5} {r.max_error:>8.1e} {r.tolerance:>7.0e} "
                     f"{'yes' if r.matches else 'NO':>5} {r.triton_ms:>9.4f} {r.torch_ms:>9.4f} "
                     f"{r.speedup:>6.2f}x {gbps} {vs}")
    lines.append("torch ms: store_kv the torch write (reshape_and_cache), decode and "
                 "decode_split paged_decode_torch, prefill paged_attention_torch. GB/s: the bytes decode "
                 "must move (decode_bytes) over the median time. vs decode: the unsplit decode kernel's time "
                 "over split-KV's (above 1: splitting wins).")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m radarlab.lab.kernel_bench`: check_kernels, printed. Exit status 1 if any kernel
    disagrees."""
    import argparse
    import inspect

    from radarlab.device import default_device

    def shapes(text: str) -> list[tuple[int, int]]:
        try:
            return [tuple(int(n) for n in item.split("x", 1)) for item in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected BATCHxCONTEXT,..., got {text!r}") from None

    def names(text: str) -> list[str]:
        return [x.strip() for x in text.split(",") if x.strip()]

    def dtype(text: str) -> torch.dtype:
        if not isinstance(getattr(torch, text, None), torch.dtype):
            raise argparse.ArgumentTypeError(f"{text!r} is not a torch dtype")
        return getattr(torch, text)

    default = {k: p.default for k, p in inspect.signature(check_kernels).parameters.items()}
    parser = argparse.ArgumentParser(prog="python -m radarlab.lab.kernel_bench", description=main.__doc__)
    # Every option defaults to check_kernels' own default (None here means "not given").
    for flag, kind, what in [("shapes", shapes, "BATCHxCONTEXT,..."),
                             ("dtypes", lambda t: [dtype(x) for x in names(t)],
                             "comma-separated torch dtypes"),
                             ("kernels", names, f"some of {','.join(KERNELS)}"),
                             ("num_heads", int, "query heads"), ("num_kv_heads", int, "KV heads"),
                             ("head_dim", int, "dims per head"), ("block_size", int, "tokens per KV block"),
                             ("prefill_tokens", int, "new tokens per sequence in the prefill check"),
                             ("tiles", lambda t: [int(x) for x in names(t)], "decode tile sizes tried"),
                             ("partition_size", int, "tokens per split-KV partition")]:
        parser.add_argument(f"--{flag.replace('_', '-')}", dest=flag, type=kind, default=None,
                            help=f"{what} (default: {default[flag]})")
    parser.add_argument("--device", default=None,
                        help="(default: cuda when present, else cpu under the interpreter)")
    args = vars(parser.parse_args(argv))
    kwargs = {k: v for k, v in args.items() if v is not None}
    kwargs["device"] = kwargs.get("device") or default_device()
    try:
        rows = check_kernels(**kwargs)
    except ValueError as err:
        parser.error(str(err))
    print(format_kernel_checks(rows), flush=True)
    return 0 if all(r.matches for r in rows) else 1


if __name__ == "__main__":
    import sys

    sys.exit(main())
