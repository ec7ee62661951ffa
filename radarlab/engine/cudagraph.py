"""CUDA graphs, the part that shapes a batch: capture sizes and padding.

A CUDA graph records a step's kernel launches once and replays them with one call, which removes the
CPU's per-launch cost (microseconds each, hundreds per step). A graph is recorded for fixed shapes
and fixed buffers, so vLLM captures one graph per batch size in a list, and pads a batch up to the
next captured size; the padding tokens get slot -1 in the slot mapping, which the KV write skips, and
their outputs are dropped. Batches above the largest size run without a graph. The list follows
vLLM 0.32's default (CompilationConfig.cudagraph_capture_sizes): 1, 2, 4, then steps of 8 up to 256,
then steps of 16 up to max_cudagraph_capture_size (512 unless set).
"""
from __future__ import annotations

import bisect
from typing import Sequence

from radarlab.util import require_int


def capture_sizes(max_size: int = 512) -> list[int]:
    """vLLM's default list of batch sizes (in tokens) to capture graphs for, up to max_size."""
    max_size = require_int("max_size", max_size)
    sizes = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, max_size + 1, 16))
    return [s for s in sizes if s <= max_size]


def padded_size(num_tokens: int, sizes: Sequence[int]) -> int | None:
    """The captured size a batch of num_tokens runs at (the smallest one that holds it), or None when
    it is larger than every captured size and runs eagerly."""
    num_tokens = require_int("num_tokens", num_tokens)
    if list(sizes) != sorted(set(sizes)) or not sizes:
        raise ValueError(f"sizes must be a non-empty, strictly increasing list, got {list(sizes)}")
    i = bisect.bisect_left(sizes, num_tokens)
    return sizes[i] if i < len(sizes) else None
