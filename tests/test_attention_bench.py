"""radarlab.attention.bench: random paged batches, the bytes and FLOPs of a decode step, and the bandwidth sweep.

The arithmetic is checked by hand-worked numbers and by counting the bytes of real tensors; the
bandwidth sweep runs here on tiny shapes (under Triton's interpreter on CPU), so the code a GPU runs
for notebook 04's roofline is exercised everywhere except for do_bench itself.
"""
from __future__ import annotations

import math

import pytest
import torch

from radarlab.attention.bench import (
    DecodeBandwidth, decode_bytes, decode_flops, measure_decode_bandwidth, random_paged_batch,
)
from radarlab.attention.torch_paged import paged_attention_torch
from radarlab.util import cdiv


def test_decode_bytes_by_hand():
    # K and V: 2 x (5 + 16) tokens x 2 kv heads x 8 dims x 2 bytes = 1344; q and out: 2 x 2 seqs x 4 heads
    # x 8 x 2 = 256; block-table entries: (2 + 4) blocks of 4 x 4 bytes = 24.
    assert decode_bytes([5, 16], 4, 2, 8, 4, 2) == 1344 + 256 + 24


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_decode_bytes_counts_the_tensors_a_kernel_must_touch(block_size):
    b = random_paged_batch([1, 7, 16, 33], None, block_size, 6, 2, 8, dtype=torch.bfloat16)
    used = sum(cdiv(int(s), block_size) for s in b.seq_lens)
    expected = (sum(k.nbytes + v.nbytes for k, v in zip(b.keys, b.values)) + 2 * b.q.nbytes
                + used * b.block_tables.element_size())
    assert decode_bytes(b.seq_lens.tolist(), 6, 2, 8, block_size, 2) == expected


def test_gqa_shares_the_kv_read():
    """More query heads on the same KV heads add query and output bytes only, and FLOPs in proportion."""
    mha = decode_bytes([100], 2, 2, 64, 16, 2)
    gqa = decode_bytes([100], 8, 2, 64, 16, 2)
    assert gqa - mha == 2 * (8 - 2) * 64 * 2
    assert decode_flops([100], 8, 2, 64) == 4 * decode_flops([100], 2, 2, 64) == 4 * 100 * 8 * 64


def test_decode_intensity_is_two_flops_per_group_member_per_value_byte():
    """Long contexts: FLOP/byte tends to 2 x group / bytes per value (3 for the course model in bf16)."""
    seq_lens = [1 << 20]
    intensity = decode_flops(seq_lens, 9, 3, 64) / decode_bytes(seq_lens, 9, 3, 64, 16, 2)
    assert math.isclose(intensity, 2 * 3 / 2, rel_tol=1e-3)


@pytest.mark.parametrize("bad, match", [
    (dict(seq_lens=[]), "seq_lens"), (dict(seq_lens=[4, 0]), "seq_lens"),
    (dict(num_heads=9, num_kv_heads=2), "multiple"), (dict(head_dim=0), "head_dim"),
    (dict(block_size=12), "block_size"),
])
def test_decode_bytes_rejects_bad_shapes(bad, match):
    args = dict(seq_lens=[4], num_heads=4, num_kv_heads=2, head_dim=8, block_size=4, bytes_per_value=2) | bad
    with pytest.raises(ValueError, match=match):
        decode_bytes(**args)


def test_random_paged_batch_pages_the_sequences_it_keeps():
    b = random_paged_batch([1, 5, 23], [1, 2, 23], block_size=4, num_heads=4, num_kv_heads=2, head_dim=8, seed=3)
    assert b.query_lens == [1, 2, 23] and b.seq_lens.tolist() == [1, 5, 23]
    assert b.block_tables.shape == (3, 6) and b.block_tables.dtype == torch.int32
    for s, (seq_len, k, v) in enumerate(zip(b.seq_lens.tolist(), b.keys, b.values)):
        for pos in range(seq_len):
            block = int(b.block_tables[s, pos // 4])
            assert torch.equal(b.k_cache[block, pos % 4], k[pos]) and torch.equal(b.v_cache[block, pos % 4], v[pos])
        assert (b.block_tables[s, cdiv(seq_len, 4):] == -1).all()
    owned = torch.zeros(b.k_cache.shape[:2], dtype=torch.bool)
    for s, seq_len in enumerate(b.seq_lens.tolist()):
        for pos in range(seq_len):
            owned[int(b.block_tables[s, pos // 4]), pos % 4] = True
    assert b.k_cache[~owned].isnan().all() and not b.k_cache[owned].isnan().any()
    # the reference is the torch gather path's answer
    out = paged_attention_torch(b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc, b.scale)
    torch.testing.assert_close(out, b.reference(), rtol=0, atol=1e-6)


def test_random_paged_batch_rejects_bad_lengths():
    with pytest.raises(ValueError, match="query_len"):
        random_paged_batch([4], [5])
    with pytest.raises(ValueError, match="query_lens has 1"):
        random_paged_batch([4, 2], [1])
    with pytest.raises(ValueError, match="block_size"):
        random_paged_batch([4], block_size=3)


def test_bandwidth_is_bytes_over_time():
    row = DecodeBandwidth(batch=2, context=10, nbytes=3_000_000, triton_ms=2.0, tile_n=32, torch_ms=6.0,
                          max_error=0.0)
    assert row.triton_gbps == 1.5 and row.torch_gbps == 0.5


def test_measure_decode_bandwidth_on_tiny_shapes():
    """The notebook's GPU sweep, run small: checked output, a tile chosen, bytes from decode_bytes."""
    rows = measure_decode_bandwidth([3, 17], batch=2, num_heads=4, num_kv_heads=2, head_dim=16, block_size=4,
                                    dtype=torch.float32, device="cpu", tiles=(16,))
    assert [(r.batch, r.context, r.tile_n) for r in rows] == [(2, 3, 16), (2, 17, 16)]
    for r in rows:
        assert r.max_error < 1e-5 and r.triton_ms > 0 and r.torch_ms > 0
        assert r.nbytes == decode_bytes([r.context] * 2, 4, 2, 16, 4, 4)
