"""radarlab.models.linear: same parameters as nn.Linear; on a CPU without bf16 instructions, bf16
matmuls of many rows run in fp32 and round back, which must agree with the native bf16 GEMM."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from radarlab.models import linear
from radarlab.models.linear import UPCAST_MIN_ROWS, Linear


@pytest.fixture
def no_native_half(monkeypatch):
    monkeypatch.setattr(linear, "cpu_has_native_half", lambda: False)


def test_state_dict_matches_nn_linear():
    torch.manual_seed(0)
    ours, theirs = Linear(8, 4, bias=True), nn.Linear(8, 4, bias=True)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(3, 8)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)


@pytest.mark.parametrize("dtype, rows, expected", [
    (torch.float32, 64, False),  # fp32 is already the fast path
    (torch.bfloat16, UPCAST_MIN_ROWS - 1, False),  # too few rows to pay for converting the weight
    (torch.bfloat16, UPCAST_MIN_ROWS, True),
    (torch.float16, 64, True),
])
def test_which_path(no_native_half, dtype, rows, expected):
    w = torch.zeros(4, 8, dtype=dtype)
    assert linear.upcasts(torch.zeros(rows, 8, dtype=dtype), w) is expected
    assert linear.upcasts(torch.zeros(2, rows // 2 or 1, 8, dtype=dtype), w) is (expected and rows % 2 == 0)


def test_native_half_cpu_never_upcasts(monkeypatch):
    monkeypatch.setattr(linear, "cpu_has_native_half", lambda: True)
    assert not linear.upcasts(torch.zeros(64, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize("bias", [False, True])
def test_upcast_equals_fp32_math_rounded_to_bf16(no_native_half, bias):
    torch.manual_seed(1)
    layer = Linear(96, 48, bias=bias).to(torch.bfloat16)
    x = torch.randn(32, 96).to(torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16
    b = None if layer.bias is None else layer.bias.float()
    want = F.linear(x.float(), layer.weight.float(), b).to(torch.bfloat16)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    # ...and within one bf16 rounding of torch's own bf16 GEMM (which also accumulates in fp32)
    native = F.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(out.float(), native.float(), rtol=2 ** -7, atol=1e-2)


def test_packed_row_linear_equals_f_linear_and_survives_copies():
    """The LM head's one-row path (MKL's packed GEMM where torch has it) gives F.linear's result up to
    fp32 rounding, repacks when the weight changes, and a model holding it can be deep-copied."""
    import copy

    from radarlab.models.linear import PackedRowLinear

    torch.manual_seed(0)
    head = PackedRowLinear(64, 300, bias=False)
    x = torch.randn(1, 64)
    torch.testing.assert_close(head(x), F.linear(x, head.weight), rtol=1e-4, atol=1e-4)
    twin = copy.deepcopy(head)  # after a call: the packed copy must not travel
    torch.testing.assert_close(twin(x), head(x), rtol=0, atol=0)
    with torch.no_grad():
        head.weight.mul_(2)
    torch.testing.assert_close(head(x), F.linear(x, head.weight), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(twin(x), F.linear(x, twin.weight), rtol=1e-4, atol=1e-4)
