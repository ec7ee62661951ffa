"""Capture sizes and padding, as vLLM 0.32 chooses them."""
from __future__ import annotations

import pytest

from radarlab.engine.cudagraph import capture_sizes, padded_size


def test_default_sizes_follow_vllms_pattern():
    sizes = capture_sizes()
    assert sizes[:5] == [1, 2, 4, 8, 16] and 248 in sizes and 256 in sizes and 264 not in sizes
    assert sizes[-2:] == [496, 512] and len(sizes) == 3 + 31 + 17
    assert capture_sizes(100)[-1] == 96


@pytest.mark.parametrize("n, want", [(1, 1), (3, 4), (5, 8), (9, 16), (256, 256), (257, 272), (512, 512),
                                     (513, None)])
def test_a_batch_pads_to_the_next_captured_size(n, want):
    assert padded_size(n, capture_sizes()) == want


def test_bad_input():
    with pytest.raises(ValueError, match="num_tokens"):
        padded_size(0, [1, 2])
    with pytest.raises(ValueError, match="strictly increasing"):
        padded_size(3, [4, 2])
    with pytest.raises(ValueError, match="max_size"):
        capture_sizes(0)
