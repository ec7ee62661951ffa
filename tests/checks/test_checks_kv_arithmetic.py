"""The checkers of notebook 01: the notebook's solutions pass, and typical mistakes get a plain
counterexample."""
from __future__ import annotations

import math

import pytest

from radarlab.checks import check_kv_bytes_per_token, check_max_streams

# --- kv_bytes_per_token --------------------------------------------------------------------------

def kv_bytes_per_token(layers, kv_heads, head_dim, bytes_per_value):
    return layers * kv_heads * head_dim * 2 * bytes_per_value


def _keys_only(layers, kv_heads, head_dim, bytes_per_value):  # forgets the V half of the cache
    return layers * kv_heads * head_dim * bytes_per_value


def _one_layer(layers, kv_heads, head_dim, bytes_per_value):  # forgets that every layer has its own cache
    return kv_heads * head_dim * 2 * bytes_per_value


def _bits(layers, kv_heads, head_dim, bytes_per_value):  # multiplies by 8 as if the answer were in bits
    return kv_bytes_per_token(layers, kv_heads, head_dim, bytes_per_value) * 8


def _whole_bytes(layers, kv_heads, head_dim, bytes_per_value):  # int(0.5) = 0: INT4 takes no memory
    return kv_bytes_per_token(layers, kv_heads, head_dim, int(bytes_per_value))


def test_kv_bytes_solution_passes(verdict):
    verdict(check_kv_bytes_per_token, kv_bytes_per_token)


@pytest.mark.parametrize("fn, words", [
    (_keys_only, "returned 163840, expected 327680 (count both K and V"),
    (_one_layer, "returned 4096, expected 327680 (sum over all the layers"),
    (_bits, "returned 2621440, expected 327680 (that is bits"),
    (_whole_bytes, "INT4 without scales (0.5 bytes per value) it returned 0, expected 81920"),
])
def test_kv_bytes_mistakes_are_described(verdict, fn, words):
    verdict(check_kv_bytes_per_token, fn, words)


# --- max_streams ---------------------------------------------------------------------------------

def max_streams(gpu_mem_gb, weights_gb, gb_per_stream):
    free = gpu_mem_gb - weights_gb
    if free <= 0:
        return 0
    return math.floor(free / gb_per_stream)


def _negative(gpu_mem_gb, weights_gb, gb_per_stream):  # no guard: weights larger than the GPU
    return math.floor((gpu_mem_gb - weights_gb) / gb_per_stream)


def _ignores_weights(gpu_mem_gb, weights_gb, gb_per_stream):  # divides the whole GPU among streams
    return math.floor(gpu_mem_gb / gb_per_stream)


def _absolute_difference(gpu_mem_gb, weights_gb, gb_per_stream):  # abs() hides the overflow
    return math.floor(abs(gpu_mem_gb - weights_gb) / gb_per_stream)


def _rounds(gpu_mem_gb, weights_gb, gb_per_stream):  # round, not floor: 4.4 streams become 4, 4.5 become 5
    return max(0, round((gpu_mem_gb - weights_gb) / gb_per_stream))


def _fraction(gpu_mem_gb, weights_gb, gb_per_stream):  # forgets to round at all
    return max(0.0, (gpu_mem_gb - weights_gb) / gb_per_stream)


def _strictly_less(gpu_mem_gb, weights_gb, gb_per_stream):  # a stream must fit with room to spare
    n = 0
    while (n + 1) * gb_per_stream < gpu_mem_gb - weights_gb:
        n += 1
    return n


def test_max_streams_solution_passes(verdict):
    verdict(check_max_streams, max_streams)


@pytest.mark.parametrize("fn, words", [
    (_negative, "returned -92, expected 0 (when the weights do not fit, no stream fits: return 0)"),
    (_ignores_weights, "returned 16, expected 4 (the weights come first"),
    (_absolute_difference, "returned 92, expected 0 (the weights alone fill the GPU"),
    (_rounds, "returned 5, expected 4 (round down"),
    (_fraction, "expected 4 (a stream needs its whole context: round down to a whole number)"),
    (_strictly_less, "exactly 12 GB per stream it returned 3, expected 4 (a stream that exactly fills the "
                     "memory left still fits)"),
])
def test_max_streams_mistakes_are_described(verdict, fn, words):
    verdict(check_max_streams, fn, words)
