"""radarlab.lab.kernel_bench: random paged batches, the bytes and FLOPs of a decode step, and the kernel
check.

The arithmetic is checked by hand-worked numbers and by counting the bytes of real tensors; the
bandwidth sweep runs here on tiny shapes (under Triton's interpreter on CPU), so the code a GPU runs
for notebook 04's roofline is exercised everywhere except for do_bench itself.
"""
from __future__ import annotations

import math

import pytest
import torch

from radarlab.attention.torch_paged import paged_attention_torch
from radarlab.lab.kernel_bench import (
    DecodeBandwidth,
    KernelCheck,
    check_kernels,
    decode_bytes,
    decode_flops,
    main,
    measure_decode_bandwidth,
    random_paged_batch,
    tolerance,
)
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
    b = random_paged_batch([1, 5, 23], [1, 2, 23], block_size=4, num_heads=4, num_kv_heads=2, head_dim=8,
                           seed=3)
    assert b.query_lens == [1, 2, 23] and b.seq_lens.tolist() == [1, 5, 23]
    assert b.block_tables.shape == (3, 6) and b.block_tables.dtype == torch.int32
    for s, (seq_len, k, v) in enumerate(zip(b.seq_lens.tolist(), b.keys, b.values)):
        for pos in range(seq_len):
            block = int(b.block_tables[s, pos // 4])
            assert torch.equal(b.k_cache[block, pos % 4], k[pos]) and torch.equal(b.v_cache[block, pos % 4],
                                                                                  v[pos])
        assert (b.block_tables[s, cdiv(seq_len, 4):] == -1).all()
    owned = torch.zeros(b.k_cache.shape[:2], dtype=torch.bool)
    for s, seq_len in enumerate(b.seq_lens.tolist()):
        for pos in range(seq_len):
            owned[int(b.block_tables[s, pos // 4]), pos % 4] = True
    assert b.k_cache[~owned].isnan().all() and not b.k_cache[owned].isnan().any()
    # the reference is the torch gather path's answer
    out = paged_attention_torch(b.q, b.k_cache, b.v_cache, b.block_tables, b.seq_lens, b.query_start_loc,
                                b.scale)
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


def test_slot_mapping_points_at_each_sequences_new_tokens():
    b = random_paged_batch([5, 9], [2, 3], block_size=4, seed=1)
    slots = b.slot_mapping()
    assert slots.tolist() == [int(b.block_tables[s, p // 4]) * 4 + p % 4 for s,
                              p in [(0, 3), (0, 4), (1, 6), (1, 7), (1, 8)]]
    flat = b.k_cache.view(-1, *b.k_cache.shape[2:])
    torch.testing.assert_close(flat[slots], torch.cat([b.keys[0][3:], b.keys[1][6:]]), rtol=0, atol=0)


def test_tolerance_is_a_few_ulps_of_the_output_dtype():
    assert tolerance(torch.float32) == 1e-4  # the floor: fp32 sums over long contexts
    assert tolerance(torch.bfloat16) == 4 * 2**-7 and tolerance(torch.float16) == 4 * 2**-10


TINY = dict(num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, prefill_tokens=3, device="cpu",
            tiles=(16,), partition_size=8)


@pytest.mark.slow
def test_check_kernels_on_tiny_shapes():
    """What gpu_check.sh runs, small and interpreted: every kernel agrees with its torch counterpart."""
    rows = check_kernels([(2, 5), (1, 17)], [torch.float32], **TINY)
    assert [(r.kernel, r.batch, r.context, r.query_len) for r in rows] == [
        ("store_kv", 2, 5, 1), ("decode", 2, 5, 1), ("decode_split", 2, 5, 1), ("prefill", 2, 5, 3),
        ("store_kv", 1, 17, 1), ("decode", 1, 17, 1), ("decode_split", 1, 17, 1), ("prefill", 1, 17, 3)]
    assert all(r.matches and r.triton_ms > 0 and r.torch_ms > 0 for r in rows)
    assert all(r.max_error == 0 for r in rows if r.kernel == "store_kv")  # a write is a copy: exact
    decode = rows[1]
    assert decode.nbytes == decode_bytes([5, 5], 4, 2, 16, 4, 4) and decode.triton_gbps > 0
    assert rows[0].nbytes is None and rows[0].triton_gbps is None
    # split-KV (17 tokens: partitions of 8, 8 and 1) moves the same bytes, and is timed beside decode
    split = rows[6]
    assert split.nbytes == decode_bytes([17], 4, 2, 16, 4,
                                        4) and split.unsplit_ms > 0 and split.vs_unsplit > 0
    assert all(r.vs_unsplit is None for r in rows if r.kernel != "decode_split")


def test_check_kernels_rejects_a_bad_partition_size():
    with pytest.raises(ValueError, match="partition_size"):
        check_kernels([(1, 5)], [torch.float32], ["decode_split"], **(TINY | dict(partition_size=2)))


@pytest.mark.parametrize("kernel, name, wrong", [
    ("store_kv", "triton_reshape_and_cache", lambda *args, **kwargs: None),  # writes nothing
    ("decode", "triton_paged_decode", lambda q, *args, **kwargs: torch.zeros_like(q)),
    ("decode_split", "triton_paged_decode_split", lambda q, *args, **kwargs: torch.zeros_like(q)),
    ("prefill", "triton_paged_prefill", lambda q, *args, **kwargs: torch.zeros_like(q)),
])
def test_check_kernels_reports_a_kernel_that_disagrees(monkeypatch, capsys, kernel, name, wrong):
    import radarlab.attention.triton_paged as tp

    monkeypatch.setattr(tp, name, wrong)
    (row,) = check_kernels([(2, 5)], [torch.float32], [kernel], **TINY)
    assert not row.matches and row.max_error > row.tolerance
    assert main(["--shapes", "2x5", "--dtypes", "float32", "--kernels", kernel, "--num-heads", "4",
                 "--num-kv-heads", "2", "--head-dim", "16", "--block-size", "4", "--tiles", "16",
                 "--prefill-tokens", "3", "--partition-size", "8", "--device", "cpu"]) == 1
    assert " NO " in capsys.readouterr().out


def test_main_prints_the_table_and_exits_0_when_all_match(capsys):
    assert main(["--shapes", "2x5", "--dtypes", "bfloat16", "--num-heads", "4", "--num-kv-heads", "2",
                 "--head-dim", "16", "--block-size", "4", "--tiles", "16", "--prefill-tokens", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["kernel", "dtype"]
    rows = [line.split() for line in lines[1:5]]
    assert [r[0] for r in rows] == ["store_kv", "decode", "decode_split", "prefill"]
    assert all(r[1] == "bfloat16" and r[7] == "yes" for r in rows)
    assert rows[2][-1].endswith("x") and rows[1][-1] == "-"  # only split-KV is timed against decode


@pytest.mark.parametrize("argv", [["--kernels", "gemm"], ["--dtypes", "float9"], ["--shapes", "8by512"],
                                  ["--kernels", "decode_split", "--partition-size", "24"]])
def test_main_rejects_bad_arguments(argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2


def test_kernel_check_row_arithmetic():
    row = KernelCheck("decode", "float32", 2, 10, 1, max_error=1e-5, tolerance=1e-4, triton_ms=2.0,
                      torch_ms=6.0, nbytes=3_000_000)
    assert row.matches and row.speedup == 3.0 and row.triton_gbps == 1.5 and row.vs_unsplit is None
    split = KernelCheck("decode_split", "float32", 4, 16384, 1, 1e-5, 1e-4, 2.0, 6.0, 3_000_000,
                        unsplit_ms=5.0)
    assert split.vs_unsplit == 2.5
    assert not KernelCheck("prefill", "float32", 1, 4, 4, float("nan"), 1e-4, 1.0, 1.0).matches
