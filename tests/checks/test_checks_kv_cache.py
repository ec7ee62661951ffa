"""The checkers of notebook 02: a reference passes, and typical mistakes get a plain counterexample."""
from __future__ import annotations

import pytest
import torch

from radarlab.attention.backends.contiguous_attn import ContiguousBackend
from radarlab.checks import check_contiguous_attention, check_reservation_utilisation

# --- contiguous_attention -------------------------------------------------------------------------
# A learner's answer written from scratch (no radarlab attention), with switches for the mistakes.


def attention_step(q, k, v, k_cache, v_cache, meta, scale, *, causal=True, mask_from_zero=False,
                   gqa_modulo=False, write_at=lambda start: start, row_of=lambda b, row: row, use_scale=True,
                   whole_row=False, new_only=False, v_gets_k=False):
    out = torch.empty_like(q)
    bounds = meta.query_start_loc.tolist()
    heads, kv_heads = q.shape[1], k.shape[1]
    group = heads // kv_heads
    for b, (row, seq_len) in enumerate(zip(meta.cache_rows.tolist(), meta.seq_lens.tolist())):
        lo, hi = bounds[b], bounds[b + 1]
        n = hi - lo
        at, r = write_at(seq_len - n), row_of(b, row)
        k_cache[r, at:at + n] = k[lo:hi]
        v_cache[r, at:at + n] = k[lo:hi] if v_gets_k else v[lo:hi]
        keys, values = k_cache[row, :seq_len], v_cache[row, :seq_len]
        if whole_row:
            keys, values = k_cache[row], v_cache[row]
        if new_only:
            keys, values = k[lo:hi], v[lo:hi]
        kv_head = [h % kv_heads if gqa_modulo else h // group for h in range(heads)]
        scores = torch.einsum("qhd,khd->hqk", q[lo:hi], keys[:, kv_head]) * (scale if use_scale else 1.0)
        if causal:
            offset = 0 if mask_from_zero else keys.shape[0] - n
            visible = torch.arange(keys.shape[0])[None, :] <= torch.arange(n)[:, None] + offset
            scores = scores.masked_fill(~visible, float("-inf"))
        out[lo:hi] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values[:, kv_head])
    return out


def _with(**mistake):
    return lambda *args: attention_step(*args, **mistake)


def test_contiguous_attention_reference_passes(verdict):
    verdict(check_contiguous_attention, ContiguousBackend().attention)


def test_contiguous_attention_written_from_scratch_passes(verdict):
    verdict(check_contiguous_attention, attention_step)


@pytest.mark.parametrize("mistake, words", [
    ({"causal": False}, "there is no causal mask"),
    ({"mask_from_zero": True}, "the causal mask places the queries at positions 0 .. n-1"),
    ({"gqa_modulo": True}, "query head h reads KV head h % num_kv_heads"),
    ({"use_scale": False}, "the softmax scale is missing"),
    ({"whole_row": True}, "attends over the whole reserved row"),
    ({"new_only": True}, "attends over this step's k, v only"),
    ({"write_at": lambda start: 0}, "written at the start of the row, positions 0 .. n-1"),
    ({"write_at": lambda start: start + 1}, "written one position late"),
    ({"row_of": lambda b, row: b}, "written in row 0, the sequence's index, not cache_rows[0] = 2"),
    ({"v_gets_k": True}, "the value cache holds sequence 0's new keys"),
], ids=["no causal mask", "mask from position 0", "GQA h % kv_heads", "scale missing", "whole row",
        "new tokens only", "written at position 0", "written one late", "row = index", "keys into values"])
def test_contiguous_attention_mistakes_are_named(verdict, mistake, words):
    verdict(check_contiguous_attention, _with(**mistake), words)


def test_contiguous_attention_own_scale_is_named(verdict):
    def own_scale(q, k, v, k_cache, v_cache, meta, scale):
        return attention_step(q, k, v, k_cache, v_cache, meta, q.shape[-1] ** -0.5)

    verdict(check_contiguous_attention, own_scale, "1/sqrt(head_dim), not the `scale` argument")


def test_contiguous_attention_wrong_layout_and_untouched_rows(verdict):
    def heads_first(*args):
        return attention_step(*args).transpose(0, 1)

    def clears_the_row(q, k, v, k_cache, v_cache, meta, scale):
        out = attention_step(q, k, v, k_cache, v_cache, meta, scale)
        k_cache[1] = 0  # row 1 belongs to no sequence of the step
        return out

    verdict(check_contiguous_attention, heads_first, "[tokens, heads, head_dim], the layout of q")
    verdict(check_contiguous_attention, clears_the_row, "row 1, position 0 holds the wrong values; it should "
                                                        "hold what it held before")


def test_contiguous_backend_takes_the_step_as_an_argument():
    with pytest.raises(TypeError, match="attention must be a function"):
        ContiguousBackend("contiguous_attention")


# --- reservation_utilisation ---------------------------------------------------------------------

def utilisation_reference(context_lens, max_model_len, block_size):
    if not context_lens or any(not 1 <= n <= max_model_len for n in context_lens):
        raise ValueError("bad context_lens")
    used = sum(context_lens)
    return (used / (len(context_lens) * max_model_len),
            used / sum(-(-n // block_size) * block_size for n in context_lens))


def _floor_blocks(context_lens, max_model_len, block_size):
    utilisation_reference(context_lens, max_model_len, block_size)
    used = sum(context_lens)
    return (used / (len(context_lens) * max_model_len),
            used / sum(n // block_size * block_size for n in context_lens))


def _no_validation(context_lens, max_model_len, block_size):
    used = sum(context_lens)
    return used / max(1, len(context_lens) * max_model_len), 1.0 if not context_lens else \
        used / sum(-(-n // block_size) * block_size for n in context_lens)


def _longest_row(context_lens, max_model_len, block_size):  # reserves the longest request, not max_model_len
    utilisation_reference(context_lens, max_model_len, block_size)
    return sum(context_lens) / (len(context_lens) * max(context_lens)), \
        utilisation_reference(context_lens, max_model_len, block_size)[1]


def test_utilisation_reference_passes(verdict):
    verdict(check_reservation_utilisation, utilisation_reference)


@pytest.mark.parametrize("fn, words", [
    (_floor_blocks, "round each request's blocks up"),
    (_no_validation, "expected it to raise ValueError"),
    (_longest_row, "contiguous utilisation was"),
])
def test_utilisation_mistakes_are_described(verdict, fn, words):
    verdict(check_reservation_utilisation, fn, words)
