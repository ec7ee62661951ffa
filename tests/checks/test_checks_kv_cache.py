"""The checkers of notebook 02: a reference passes, and typical mistakes get a plain counterexample."""
from __future__ import annotations

import pytest

from radarlab.checks import check_append_to_contiguous_cache, check_reservation_utilisation

# --- append_to_contiguous_cache ------------------------------------------------------------------

def append_reference(k_cache, v_cache, row, seq_len, k, v):
    start = seq_len - k.shape[0]
    k_cache[row, start:seq_len] = k
    v_cache[row, start:seq_len] = v
    return k_cache[row, :seq_len], v_cache[row, :seq_len]


def _off_by_one(k_cache, v_cache, row, seq_len, k, v):  # writes at seq_len - n + 1
    start = seq_len - k.shape[0] + 1
    k_cache[row, start:start + k.shape[0]] = k[: k_cache.shape[1] - start]
    v_cache[row, start:start + k.shape[0]] = v[: v_cache.shape[1] - start]
    return k_cache[row, :seq_len], v_cache[row, :seq_len]


def _k_into_v(k_cache, v_cache, row, seq_len, k, v):
    return append_reference(k_cache, v_cache, row, seq_len, k, k)


def _wrong_row(k_cache, v_cache, row, seq_len, k, v):
    return append_reference(k_cache, v_cache, 0, seq_len, k, v)


def _returns_only_new(k_cache, v_cache, row, seq_len, k, v):
    append_reference(k_cache, v_cache, row, seq_len, k, v)
    return k, v


def _not_in_place(k_cache, v_cache, row, seq_len, k, v):
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    return append_reference(k_cache, v_cache, row, seq_len, k, v)


def test_append_reference_passes(verdict):
    verdict(check_append_to_contiguous_cache, append_reference)


@pytest.mark.parametrize("fn, words", [
    (_off_by_one, "position 0 holds the wrong values"),
    (_k_into_v, "the value cache"),
    (_wrong_row, "row 0"),
    (_returns_only_new, "returned keys were shape"),
    (_not_in_place, "Write in place"),
])
def test_append_mistakes_are_described(verdict, fn, words):
    verdict(check_append_to_contiguous_cache, fn, words)


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
