"""Small helpers every room uses: ceiling division, and argument checks whose errors name the argument.

One home for each, so that a rule such as "a count is a positive int, and True is not a count" is
written once and reads the same wherever it fails.
"""
from __future__ import annotations

import math
import numbers
import os
from pathlib import Path


def cache_dir() -> Path:
    """Where radarlab keeps what it makes once (the converted course model, built C++ operators):
    RADARLAB_CACHE, else ~/.cache/radarlab."""
    root = os.environ.get("RADARLAB_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "radarlab"


def cdiv(a, b):
    """Ceiling division for ints and integer tensors: the blocks that hold a tokens, b per block."""
    return -(-a // b)


def is_int(value) -> bool:
    """An integer (numpy's too), but not a bool: True is not a count."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def require_int(name: str, value, minimum: int | None = 1, maximum: int | None = None) -> int:
    """value as a Python int, or ValueError naming `name`. The default, minimum=1, is a positive count;
    minimum=0 a non-negative one (seeds, warm-up runs); None, any int."""
    if not is_int(value):
        raise ValueError(f"{name} must be an int, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        what = {1: "a positive int", 0: "a non-negative int"}.get(minimum, f"an int >= {minimum}")
        raise ValueError(f"{name} must be {what}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be an int <= {maximum}, got {value!r}")
    return value


def require_power_of_two(name: str, value) -> int:
    """A power of two >= 1 (block sizes, tile sizes), or ValueError naming `name`."""
    if not is_int(value) or value < 1 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two (1, 2, 4, 8, 16, ...), got {value!r}")
    return int(value)


def require_number(name: str, value, minimum: float | None = None, *, positive: bool = False) -> float:
    """A finite real number (not a bool), optionally > 0 or >= minimum, or ValueError naming `name`."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if positive and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return float(value)
