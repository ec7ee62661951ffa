"""Attention over the paged cache (torch gather, Triton decode, split-KV decode, Triton prefill) against
attention_reference.

Every case builds each sequence's K/V as plain tensors, scatters them into a pool through a shuffled
block table, fills every unused slot with NaN (a stray read poisons the output), and compares the
paged result with attention_reference on the plain tensors. On CPU the kernels run under Triton's
interpreter, so shapes stay tiny; on a GPU (scripts/gpu_check.sh) the same tests run compiled.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings, strategies as st

from radarlab.attention.reference import attention_reference, attention_settled
from radarlab.attention.torch_paged import (
    combine_partitions_torch,
    paged_attention_torch,
    paged_decode_torch,
    split_kv_decode_torch,
    split_kv_partials_torch,
)
from radarlab.attention.triton_paged import (
    triton_paged_attention,
    triton_paged_decode,
    triton_paged_decode_split,
    triton_paged_prefill,
)
from radarlab.device import default_device
from radarlab.util import cdiv

TOL = 1e-5  # fp32


@dataclass
class PagedCase:
    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 past each sequence's blocks
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float
    expected: torch.Tensor  # attention_reference on the unpaged K/V

    def args(self):
        return self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens


def make_case(seq_lens, query_lens, block_size, num_heads, num_kv_heads, head_dim, seed=0,
              device="cpu", spare_blocks=3, dtype=torch.float32) -> PagedCase:
    """Random q and per-sequence K/V (rounded to dtype), scattered through shuffled block tables.
    The expected output is fp32 math on exactly the values the kernels see."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [cdiv(s, block_size) for s in seq_lens]
    num_blocks = sum(per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()  # shuffled: no sequence is contiguous
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    tables = torch.full((len(seq_lens), max(per_seq) + 1), -1, dtype=torch.int32)  # >= 1 padding column
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    expected, start = [], 0
    for b, (seq_len, q_len) in enumerate(zip(seq_lens, query_lens)):
        blocks, order = order[: per_seq[b]], order[per_seq[b]:]
        tables[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        for pos in range(seq_len):
            k_cache[blocks[pos // block_size], pos % block_size] = k[pos]
            v_cache[blocks[pos // block_size], pos % block_size] = v[pos]
        expected.append(attention_reference(q[start:start + q_len].float(), k.float(), v.float(), scale))
        start += q_len
    qsl = torch.zeros(len(seq_lens) + 1, dtype=torch.long)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    to = lambda t: t.to(device)  # noqa: E731
    return PagedCase(to(q), to(k_cache), to(v_cache), to(tables), to(torch.tensor(seq_lens)), to(qsl), scale,
                     to(torch.cat(expected)))


def max_error(out, expected) -> float:
    assert not out.isnan().any(), "NaN in the output: a kernel read an unused slot"
    assert out.shape == expected.shape
    return (out.float() - expected).abs().max().item() if out.numel() else 0.0


@pytest.fixture(scope="module")
def device():
    return default_device()


BLOCK_SIZES = [1, 4, 16]
HEADS = [(4, 2, 16), (9, 3, 64)]  # (query heads, kv heads, head_dim): toy GQA, and the course model's
DECODE_LENS = [1, 5, 16, 23]  # 1, exactly one block of 16, and lengths that are not multiples
# prefill from scratch (q == seq), chunked prefill (q < seq), a decode row, and a sequence with no new tokens
PREFILL = ([1, 5, 23, 20, 33, 6], [1, 5, 23, 3, 9, 0])


# --- torch gather ---------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads", HEADS + [(2, 2, 8)])
def test_torch_gather_matches_reference(block_size, heads, device):
    case = make_case(*PREFILL, block_size, *heads, seed=block_size, device=device)
    out = paged_attention_torch(*case.args(), case.query_start_loc, case.scale)
    assert max_error(out, case.expected) < TOL


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads", HEADS)
def test_torch_batched_decode_matches_reference(block_size, heads, device):
    case = make_case(DECODE_LENS, [1] * len(DECODE_LENS), block_size, *heads, seed=7, device=device)
    out = paged_decode_torch(*case.args(), case.scale)
    assert max_error(out, case.expected) < TOL


@settings(max_examples=25, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 2, 4, 8, 16]), group=st.sampled_from([1, 2, 3]))
def test_torch_gather_random_lengths(data, block_size, group):
    seq_lens = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=4))
    query_lens = [data.draw(st.integers(0, s)) for s in seq_lens]
    case = make_case(seq_lens, query_lens, block_size, 2 * group, 2, 8, seed=data.draw(st.integers(0, 99)))
    out = paged_attention_torch(*case.args(), case.query_start_loc, case.scale)
    assert max_error(out, case.expected) < TOL


# --- Triton decode --------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads", HEADS)
def test_triton_decode_matches_reference(block_size, heads, device):
    case = make_case(DECODE_LENS, [1] * len(DECODE_LENS), block_size, *heads, seed=block_size, device=device)
    out = triton_paged_decode(*case.args(), case.scale)
    assert max_error(out, case.expected) < TOL


@pytest.mark.parametrize("tile_n", [4, 64])
def test_triton_decode_tiles_and_padded_head_dim(tile_n, device):
    """A tile smaller than a block (4 < 16) or spanning many (64); head_dim 24 padded to 32; MHA."""
    case = make_case([3, 37], [1, 1], 16, 2, 2, 24, seed=3, device=device)
    out = triton_paged_decode(*case.args(), case.scale, tile_n=tile_n)
    assert max_error(out, case.expected) < TOL


# --- split-KV decode (torch reference and Triton) -------------------------------------------------
def split_lens(block_size, partition_size):
    """1, block_size -/+ 1, a partition boundary hit exactly and just missed, and several partitions."""
    lens = [1, block_size - 1, block_size + 1, partition_size, partition_size + 1, 3 * partition_size - 1,
            3 * partition_size + 5]
    return [n for n in lens if n >= 1]


@pytest.mark.parametrize("block_size, partition_size", [(1, 4), (4, 4), (4, 16), (16, 32)])
@pytest.mark.parametrize("heads", HEADS)
def test_torch_split_kv_equals_unsplit_decode(block_size, partition_size, heads, device):
    lens = split_lens(block_size, partition_size)
    case = make_case(lens, [1] * len(lens), block_size, *heads, seed=partition_size, device=device)
    out = split_kv_decode_torch(*case.args(), case.scale, partition_size=partition_size)
    unsplit = paged_decode_torch(*case.args(), case.scale)
    torch.testing.assert_close(out, unsplit, rtol=0, atol=1e-6)  # same math, other summation order
    assert max_error(out, case.expected) < TOL


@settings(max_examples=25, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 2, 4, 8]), partition_blocks=st.sampled_from([1, 2, 4]),
       group=st.sampled_from([1, 2, 3]))
def test_torch_split_kv_random_lengths(data, block_size, partition_blocks, group):
    seq_lens = data.draw(st.lists(st.integers(1, 60), min_size=1, max_size=4))
    case = make_case(seq_lens, [1] * len(seq_lens), block_size, 2 * group, 2, 8,
                     seed=data.draw(st.integers(0, 99)))
    out = split_kv_decode_torch(*case.args(), case.scale, partition_size=block_size * partition_blocks)
    assert max_error(out, case.expected) < TOL


@pytest.mark.parametrize("block_size, partition_size, tile_n",
                         [(4, 8, 32), (4, 16, 4), (16, 16, 8), (16, 32, 64)])
@pytest.mark.parametrize("heads", HEADS)
def test_triton_split_kv_matches_both_references(block_size, partition_size, tile_n, heads, device):
    """Against attention_reference and against split_kv_decode_torch; tiles smaller than a partition
    (several per partition) and larger (clipped to it)."""
    lens = split_lens(block_size, partition_size)
    case = make_case(lens, [1] * len(lens), block_size, *heads, seed=block_size + partition_size,
                     device=device)
    out = triton_paged_decode_split(*case.args(), case.scale, partition_size=partition_size, tile_n=tile_n)
    assert max_error(out, case.expected) < TOL
    split = split_kv_decode_torch(*case.args(), case.scale, partition_size=partition_size)
    assert max_error(out, split) < TOL


def test_empty_partitions_are_skipped_and_never_read(device, monkeypatch):
    """A batch's grid has partitions for its longest sequence; a short one's extra partitions are
    empty. The torch phase 1 gives them m = -inf, l = 0, out 0 (no weight), and the Triton combine
    must not read their scratch at all: here the scratch starts as NaN, so a read would show."""
    case = make_case([1, 5, 37], [1, 1, 1], 4, 4, 2, 16, seed=11, device=device)
    outs, maxes, sums = split_kv_partials_torch(*case.args(), case.scale, partition_size=8)
    assert maxes.shape == (3, 4, 5)  # cdiv(37, 8) partitions for every sequence
    assert maxes[0, :, 1:].isinf().all() and (sums[0, :, 1:] == 0).all() and (outs[0, :, 1:] == 0).all()
    assert maxes[1, :, 1:].isinf().all() and maxes[2].isfinite().all()

    empty = torch.empty

    def nan_empty(*args, **kwargs):
        return empty(*args, **kwargs).fill_(float("nan"))

    monkeypatch.setattr(torch, "empty", nan_empty)
    out = triton_paged_decode_split(*case.args(), case.scale, partition_size=8)
    monkeypatch.undo()
    assert max_error(out, case.expected) < TOL
    # a larger max_seq_len only adds empty partitions
    more = triton_paged_decode_split(*case.args(), case.scale, partition_size=8, max_seq_len=100)
    assert max_error(more, case.expected) < TOL


def test_a_combine_without_the_max_rescale_fails_the_check(device):
    """The comparison the split-KV tests rely on can fail: merging the same partials without the
    exp(m_i - m) weights (a plain mean of the partition outputs, or weights l_i alone, each under
    its own max) misses the reference by far more than TOL, while the true combine is within it."""
    lens = split_lens(4, 8)
    case = make_case(lens, [1] * len(lens), 4, 4, 2, 16, seed=12, device=device)
    outs, maxes, sums = split_kv_partials_torch(*case.args(), case.scale, partition_size=8)
    assert max_error(combine_partitions_torch(outs, maxes, sums), case.expected) < TOL
    present = (sums > 0).float()  # the partitions that hold tokens
    mean = (outs * present[..., None]).sum(-2) / present.sum(-1)[..., None]
    by_sum_only = (outs * sums[..., None]).sum(-2) / sums.sum(-1)[..., None]
    for wrong in (mean, by_sum_only):
        assert max_error(wrong, case.expected) > 100 * TOL


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("block_size, partition_size, match", [
    (4, 12, "partition_size must be a power of two"),
    (4, 0, "partition_size must be a power of two"),
    (16, 8, r"partition_size \(8\) must be a multiple of the block size \(16\)"),
])
def test_bad_partition_size_raises(path, block_size, partition_size, match, device):
    case = make_case([5, 9], [1, 1], block_size, 4, 2, 8, device=device)
    run = split_kv_decode_torch if path == "torch" else triton_paged_decode_split
    with pytest.raises(ValueError, match=match):
        run(*case.args(), case.scale, partition_size=partition_size)


def test_split_kv_rejects_a_max_seq_len_below_the_longest(device):
    case = make_case([5, 9], [1, 1], 4, 4, 2, 8, device=device)
    with pytest.raises(ValueError, match=r"max_seq_len \(8\) is below the longest seq_len \(9\)"):
        triton_paged_decode_split(*case.args(), case.scale, partition_size=4, max_seq_len=8)


# --- Triton prefill -------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads", HEADS)
def test_triton_prefill_matches_reference(block_size, heads, device):
    case = make_case(*PREFILL, block_size, *heads, seed=block_size + 1, device=device)
    out = triton_paged_prefill(*case.args(), case.query_start_loc, case.scale)
    assert max_error(out, case.expected) < TOL


@pytest.mark.parametrize("block_size", [4, 64])
def test_triton_prefill_small_tiles_and_padded_head_dim(block_size, device):
    """Many query tiles per sequence (block_m 16 = 4 tokens x 4 heads), key tiles of 16 that span
    several blocks of 4 or sit inside one block of 64, and head_dim 24 padded to 32."""
    case = make_case([30, 9], [30, 4], block_size, 4, 1, 24, seed=5, device=device)
    out = triton_paged_prefill(*case.args(), case.query_start_loc, case.scale, block_m=16, tile_n=16)
    assert max_error(out, case.expected) < TOL


def test_dispatch_uses_decode_kernel_for_one_query_each(device, monkeypatch):
    import radarlab.attention.triton_paged as tp

    calls = []
    monkeypatch.setattr(tp, "triton_paged_prefill", lambda *a, **k: calls.append("prefill"))
    case = make_case([4, 9], [1, 1], 4, 4, 2, 16, device=device)
    out = triton_paged_attention(*case.args(), case.query_start_loc, case.scale)
    assert calls == [] and max_error(out, case.expected) < TOL
    case = make_case([4, 9], [2, 1], 4, 4, 2, 16, device=device)
    tp.triton_paged_attention(*case.args(), case.query_start_loc, case.scale)
    assert calls == ["prefill"]


@pytest.mark.parametrize("kernel", ["decode", "decode_split", "prefill"])
def test_triton_kernels_read_bf16_caches(kernel, device):
    """bf16 pools and queries: loaded, computed in fp32, stored as bf16. The only error is the final
    rounding to bf16: at most one bf16 ulp (2^-7 relative), since Triton's interpreter converts
    fp32 to bf16 by truncation where torch and compiled Triton round to nearest."""
    query_lens = [1, 9, 4] if kernel == "prefill" else [1, 1, 1]
    case = make_case([1, 9, 21], query_lens, 4, 4, 2, 16, seed=9, device=device, dtype=torch.bfloat16)
    if kernel == "decode":
        out = triton_paged_decode(*case.args(), case.scale)
    elif kernel == "decode_split":
        out = triton_paged_decode_split(*case.args(), case.scale, partition_size=8)
    else:
        out = triton_paged_prefill(*case.args(), case.query_start_loc, case.scale)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    torch.testing.assert_close(out.float(), case.expected, rtol=2**-7, atol=1e-5)


# --- bad block tables -----------------------------------------------------------------------------
def _all_paths(case):
    """Each attention path, called on a case whose sequences all have one query."""
    qsl = case.query_start_loc
    return {
        "torch": lambda: paged_attention_torch(*case.args(), qsl, case.scale),
        "torch_decode": lambda: paged_decode_torch(*case.args(), case.scale),
        "triton_decode": lambda: triton_paged_decode(*case.args(), case.scale),
        "torch_split": lambda: split_kv_decode_torch(*case.args(), case.scale, partition_size=4),
        "triton_split": lambda: triton_paged_decode_split(*case.args(), case.scale, partition_size=4),
        "triton_prefill": lambda: triton_paged_prefill(*case.args(), qsl, case.scale),
    }


@pytest.mark.parametrize("path", ["torch", "torch_decode", "triton_decode", "torch_split", "triton_split",
                                  "triton_prefill"])
@pytest.mark.parametrize("bad", ["past_pool", "negative", "too_few_columns"])
def test_block_table_outside_pool_raises(path, bad, device):
    case = make_case([5, 9], [1, 1], 4, 4, 2, 8, device=device)
    num_blocks = case.k_cache.shape[0]
    if bad == "past_pool":
        case.block_tables[1, 2] = num_blocks
        match = r"block_tables\[1, 2\] = %d is outside the pool" % num_blocks
    elif bad == "negative":
        case.block_tables[0, 1] = -1
        match = r"block_tables\[0, 1\] = -1 is outside the pool"
    else:
        case.block_tables = case.block_tables[:, :2]  # sequence 1 (9 tokens) needs 3 blocks of 4
        match = "sequence 1 .* needs 3 blocks"
    with pytest.raises(ValueError, match=match):
        _all_paths(case)[path]()


def test_padding_entries_past_the_last_block_are_never_read(device):
    """Entries past cdiv(seq_len, block_size) may hold anything; only used entries are checked."""
    case = make_case([5, 9], [1, 1], 4, 4, 2, 8, device=device)
    case.block_tables = torch.cat([case.block_tables, torch.full_like(case.block_tables, 10**6)], dim=1)
    for run in _all_paths(case).values():
        assert max_error(run(), case.expected) < TOL


def test_attention_settled_reads_stored_keys_only_below_each_querys_settled_length():
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(5, 4, 8, generator=g) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    k_fresh, v_fresh = k + 0.5, v - 0.5
    none = attention_settled(q, k, v, k_fresh, v_fresh, torch.zeros(5, dtype=torch.long), 0.3)
    every = attention_settled(q, k, v, k_fresh, v_fresh, torch.full((5,), 5), 0.3)
    assert torch.allclose(none, attention_reference(q, k_fresh, v_fresh, 0.3), atol=1e-6)
    assert torch.allclose(every, attention_reference(q, k, v, 0.3), atol=1e-6)
    mixed = attention_settled(q[2:], k, v, k_fresh, v_fresh, torch.tensor([0, 2, 4]), 0.3)
    for i, n in enumerate([0, 2, 4]):  # query i (position i + 2) reads positions < n as stored
        kk, vv = torch.cat((k[:n], k_fresh[n:i + 3])), torch.cat((v[:n], v_fresh[n:i + 3]))
        assert torch.allclose(mixed[i], attention_reference(q[i + 2:i + 3], kk, vv, 0.3)[0], atol=1e-6)
    with pytest.raises(ValueError, match="settled"):
        attention_settled(q, k, v, k_fresh, v_fresh, torch.zeros(4, dtype=torch.long), 0.3)
