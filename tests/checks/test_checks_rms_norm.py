"""The rms_norm checker of notebook 00: the reference passes, and typical mistakes get a plain
counterexample."""
from __future__ import annotations

import pytest
import torch

from radarlab.checks import check_rms_norm


def reference(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def test_reference_passes(verdict):
    verdict(check_rms_norm, reference)


def _eps_outside_sqrt(x, weight, eps):
    return weight * x / (x.pow(2).mean(-1, keepdim=True).sqrt() + eps)


def _no_weight(x, weight, eps):
    return reference(x, torch.ones_like(weight), eps)


def _wrong_dim(x, weight, eps):
    return weight * x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + eps)


def _in_place(x, weight, eps):
    x.mul_(torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    return weight * x


def _returns_fp32(x, weight, eps):
    return reference(x.float(), weight.float(), eps)


def _in_input_dtype(x, weight, eps):  # no upcast: squares and mean in fp16 overflow to inf
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _crashes(x, weight, eps):
    raise ValueError("a learner's bug")


def _wrong_shape(x, weight, eps):
    return reference(x, weight, eps).flatten()


@pytest.mark.parametrize("fn, words", [
    (_eps_outside_sqrt, "eps goes inside the square root"),
    (_no_weight, "weight=[2, 0.5, 1, -1]"),
    (_wrong_dim, "expected 0.365148"),
    (_in_place, "in place"),
    (_returns_fp32, "dtype torch.float32, expected torch.bfloat16"),
    (_in_input_dtype, "squares overflow float16, whose largest value is 65504: square and average in fp32"),
    (_crashes, "it raised ValueError: a learner's bug"),
    (_wrong_shape, "shape (4,), expected (1, 4)"),
])
def test_mistakes_get_a_counterexample(verdict, fn, words):
    verdict(check_rms_norm, fn, words)
