"""radarlab.util: the argument checks every room uses. Each error must name the argument and the value."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from radarlab.util import cdiv, is_int, require_int, require_number, require_power_of_two


@pytest.mark.parametrize("a, b, expected",
                         [(0, 16, 0), (1, 16, 1), (16, 16, 1), (17, 16, 2), (32768, 16, 2048)])
def test_cdiv_is_the_blocks_that_hold_a_tokens(a, b, expected):
    assert cdiv(a, b) == expected


def test_cdiv_on_tensors():
    assert cdiv(torch.tensor([0, 1, 4, 5]), 4).tolist() == [0, 1, 1, 2]


@pytest.mark.parametrize("value", [0, 7, -3, np.int64(5), np.int32(2), np.uint8(1)])
def test_is_int_takes_ints_and_numpy_ints(value):
    assert is_int(value)


@pytest.mark.parametrize("value", [True, False, np.bool_(True), 2.0, "3", None, torch.tensor(3)])
def test_is_int_refuses_bools_floats_and_others(value):
    assert not is_int(value)


def test_require_int_returns_a_python_int():
    out = require_int("num_blocks", np.int64(12))
    assert out == 12 and type(out) is int


@pytest.mark.parametrize("value", [True, 1.0, 2.5, "4", None])
def test_require_int_rejects_non_ints_naming_argument_and_value(value):
    with pytest.raises(ValueError, match=rf"^num_blocks must be an int, got {value!r}$"):
        require_int("num_blocks", value)


@pytest.mark.parametrize("value", [0, -1, np.int64(-5)])
def test_require_int_default_is_a_positive_count(value):
    with pytest.raises(ValueError, match=rf"^block_size must be a positive int, got {int(value)}$"):
        require_int("block_size", value)


def test_require_int_bounds():
    assert require_int("seed", 0, minimum=0) == 0
    with pytest.raises(ValueError, match=r"^seed must be a non-negative int, got -1$"):
        require_int("seed", -1, minimum=0)
    with pytest.raises(ValueError, match=r"^max_model_len must be an int >= 2, got 1$"):
        require_int("max_model_len", 1, minimum=2)
    assert require_int("top_k", 50, minimum=-1, maximum=50) == 50
    with pytest.raises(ValueError, match=r"^top_k must be an int <= 50, got 51$"):
        require_int("top_k", 51, minimum=-1, maximum=50)
    assert require_int("offset", -(10**6), minimum=None) == -(10**6)


@pytest.mark.parametrize("value", [1, 2, 16, 1024, np.int64(64)])
def test_require_power_of_two_accepts(value):
    assert require_power_of_two("block_size", value) == int(value)


@pytest.mark.parametrize("value", [0, -16, 3, 12, 48, True, 16.0])
def test_require_power_of_two_rejects_naming_argument_and_value(value):
    with pytest.raises(ValueError, match=rf"^block_size must be a power of two .*, got {value!r}$"):
        require_power_of_two("block_size", value)


def test_require_number():
    assert require_number("rate", 2) == 2.0 and require_number("rate", np.float32(0.5)) == 0.5
    assert require_number("weights_gb", 0, 0) == 0.0
    for bad in (True, float("nan"), float("inf"), "1", None):
        with pytest.raises(ValueError, match=r"^rate must be a finite number, got "):
            require_number("rate", bad)
    with pytest.raises(ValueError, match=r"^rate must be > 0, got 0$"):
        require_number("rate", 0, positive=True)
    with pytest.raises(ValueError, match=r"^weights_gb must be >= 0, got -1$"):
        require_number("weights_gb", -1, 0)
