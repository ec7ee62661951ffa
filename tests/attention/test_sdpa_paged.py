"""The engine's torch attention path (SDPA over rows gathered by a per-step plan) against the readable
reference, paged_attention_torch, and against attention_reference on the unpaged K/V.

The cases come from test_paged_attention.make_case: shuffled block tables, every unused slot NaN (a
stray read or a zero weight times a stray value poisons the output), GQA, lengths of 1 and lengths
that are not multiples of the block size, and mixed batches of prefills, chunks and decodes.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from radarlab.attention.sdpa_paged import paged_attention_sdpa, plan_paged_sdpa
from radarlab.attention.torch_paged import paged_attention_torch

from test_paged_attention import DECODE_LENS, PREFILL, TOL, make_case, max_error

HEADS = [(4, 2, 16), (9, 3, 64), (2, 2, 8)]  # toy GQA, the course model's, no GQA
MANY = [(7 * i) % 53 + 1 for i in range(67)]  # 67 decodes of lengths 1..53: four length buckets


def both(case, block_size):
    """(fast path, reference) on one case."""
    plan = plan_paged_sdpa(case.block_tables, case.seq_lens, case.query_start_loc, block_size)
    fast = paged_attention_sdpa(case.q, case.k_cache, case.v_cache, plan, case.scale)
    ref = paged_attention_torch(*case.args(), case.query_start_loc, case.scale)
    return fast, ref


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("lens", [PREFILL, (DECODE_LENS, [1] * len(DECODE_LENS)), ([1], [1]),
                                  ([7, 40, 3, 18, 1], [1, 6, 1, 18, 1]), (MANY, [1] * len(MANY)),
                                  (MANY + [30, 12], [1] * len(MANY) + [5, 12])],
                         ids=["prefill_chunks_decode_empty", "decodes", "one_token", "mixed",
                              "bucketed_decodes", "bucketed_decodes_and_prefills"])
def test_sdpa_path_equals_reference(block_size, heads, lens):
    case = make_case(*lens, block_size, *heads, seed=block_size)
    fast, ref = both(case, block_size)
    assert fast.dtype == case.q.dtype
    assert max_error(fast, case.expected) < TOL
    assert max_error(fast, ref) < TOL


@settings(max_examples=30, deadline=None)
@given(data=st.data(), block_size=st.sampled_from([1, 2, 4, 8, 16]), group=st.sampled_from([1, 2, 3]))
def test_sdpa_path_random_batches(data, block_size, group):
    seq_lens = data.draw(st.lists(st.integers(1, 40), min_size=1, max_size=6))
    query_lens = [data.draw(st.sampled_from(sorted({0, 1, s}))) if data.draw(st.booleans())
                  else data.draw(st.integers(0, s)) for s in seq_lens]
    case = make_case(seq_lens, query_lens, block_size, 2 * group, 2, 8, seed=data.draw(st.integers(0, 99)))
    fast, ref = both(case, block_size)
    assert max_error(fast, ref) < TOL and max_error(fast, case.expected) < TOL


def test_bf16_stays_bf16_and_matches_the_fp32_math():
    """No fp32 copy of the pool: q, K, V stay bf16, SDPA accumulates in fp32, and the result is
    within bf16 rounding of fp32 math on the same bf16 values."""
    case = make_case([1, 9, 21, 30], [1, 1, 4, 1], 4, 9, 3, 64, seed=3, dtype=torch.bfloat16)
    fast, _ = both(case, 4)
    assert fast.dtype == torch.bfloat16 and not fast.isnan().any()
    torch.testing.assert_close(fast.float(), case.expected, rtol=2**-7, atol=2**-8)


def test_decode_only_steps_skip_the_scatter_and_equal_lengths_skip_the_mask():
    plan = plan_paged_sdpa(torch.tensor([[0, 1], [2, 3]]), torch.tensor([5, 8]), torch.tensor([0, 1, 2]), 4)
    (bucket,) = plan.decodes
    assert bucket.rows is None and plan.context == 8 and bucket.mask.shape == (2, 1, 1, 8)
    assert bucket.mask[0, 0, 0].tolist() == [True] * 5 + [False] * 3
    # sequence 0 re-reads its last token (position 4: block 1, row 0 = slot 4) past its length
    assert bucket.slots.view(2, 8)[0].tolist() == [0, 1, 2, 3, 4, 4, 4, 4]
    same = plan_paged_sdpa(torch.tensor([[0, 1], [2, 3]]), torch.tensor([8, 8]), torch.tensor([0, 1, 2]), 4)
    assert same.decodes[0].mask is None


def test_many_decodes_go_in_length_buckets():
    """64 decodes, lengths 1..64 shuffled: four buckets of 16, each padded only to its own longest;
    16 decodes stay one call."""
    lens = [(13 * i) % 64 + 1 for i in range(64)]
    tables = torch.arange(64 * 16).view(64, 16)
    plan = plan_paged_sdpa(tables, torch.tensor(lens), torch.arange(65), 4)
    assert [b.context for b in plan.decodes] == [16, 32, 48, 64]
    for bucket in plan.decodes:  # rows name the decodes of that bucket, by their q row
        assert sorted(lens[r] for r in bucket.rows.tolist()) == list(range(bucket.context - 15,
                                                                           bucket.context + 1))
    assert sum(b.slots.numel() for b in plan.decodes) == 16 * (16 + 32 + 48 + 64)  # one bucket: 64 * 64
    few = plan_paged_sdpa(tables[:16], torch.tensor(lens[:16]), torch.arange(17), 4)
    assert len(few.decodes) == 1 and few.decodes[0].rows is None


def test_a_plan_for_another_step_is_rejected():
    case = make_case([5, 9], [1, 1], 4, 4, 2, 8)
    plan = plan_paged_sdpa(case.block_tables, case.seq_lens, case.query_start_loc, 4)
    with pytest.raises(ValueError, match="q has 3 rows but the plan was made for 2 tokens"):
        paged_attention_sdpa(torch.cat([case.q, case.q[:1]]), case.k_cache, case.v_cache, plan, case.scale)


def test_the_plan_says_whether_the_step_has_padding_slots():
    tables, lens, starts = torch.tensor([[0, 1], [2, 3]]), torch.tensor([5, 8]), torch.tensor([0, 1, 2])
    assert plan_paged_sdpa(tables, lens, starts, 4).padded  # no slot mapping given: the write must look
    assert not plan_paged_sdpa(tables, lens, starts, 4, torch.tensor([4, 15])).padded
    assert plan_paged_sdpa(tables, lens, starts, 4, torch.tensor([4, -1])).padded
