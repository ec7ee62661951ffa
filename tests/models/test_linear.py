"""radarlab.models.linear: same parameters as nn.Linear; on a CPU without bf16 instructions, bf16
matmuls of many rows run in fp32 and round back, which must agree with the native bf16 GEMM; inference
matmuls run through oneDNN's packed weight, which must agree with F.linear and follow weight changes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from radarlab.models import linear
from radarlab.models.linear import UPCAST_MIN_ROWS, UPCAST_MIN_ROWS_ONEDNN, Linear, PackedWeight, fused_linear

needs_onednn = pytest.mark.skipif(not linear.onednn_packed_gemm(),
                                  reason="torch built without oneDNN's packed linear")


# The three kinds of x86 CPU as the bf16 rule sees them: (bf16 instructions, oneDNN bf16 GEMMs).
CPU_CLASSES = {"avx512_bf16": (True, True), "avx512": (False, True), "avx2": (False, False)}
# The vendors as the fp32 rule sees them (cpuinfo's vendor_id).
INTEL, AMD = "GenuineIntel", "AuthenticAMD"


def as_vendor(monkeypatch, vendor: str) -> None:
    monkeypatch.setattr(linear, "mkl_gemv_rows", lambda: linear.gemv_rows_for(vendor))


def as_cpu(monkeypatch, kind: str, vendor: str = AMD) -> None:
    native, onednn = CPU_CLASSES[kind]
    monkeypatch.setattr(linear, "cpu_has_native_half", lambda: native)
    monkeypatch.setattr(linear, "onednn_bf16", lambda: onednn)
    monkeypatch.setattr(linear, "onednn_packed_gemm", lambda: True)
    as_vendor(monkeypatch, vendor)


@pytest.fixture
def count_packs(monkeypatch):
    """How many times a weight was packed (wraps oneDNN's reorder)."""
    calls = []
    real = torch.ops.mkldnn._reorder_linear_weight

    class Ops:
        _linear_pointwise = torch.ops.mkldnn._linear_pointwise

        @staticmethod
        def _reorder_linear_weight(*args):
            calls.append(args[0].shape)
            return real(*args)

    monkeypatch.setattr(linear.torch.ops, "mkldnn", Ops)
    return calls


def test_state_dict_matches_nn_linear():
    torch.manual_seed(0)
    ours, theirs = Linear(8, 4, bias=True), nn.Linear(8, 4, bias=True)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(3, 8)
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)


@pytest.mark.parametrize("kind, dtype, rows, expected", [
    ("avx2", torch.float32, 64, False),  # fp32 is already the fast path
    ("avx2", torch.bfloat16, UPCAST_MIN_ROWS - 1, False),  # too few rows to pay for converting the weight
    ("avx2", torch.bfloat16, UPCAST_MIN_ROWS, True),
    ("avx2", torch.float16, 64, True),
    ("avx512", torch.bfloat16, UPCAST_MIN_ROWS, False),  # oneDNN's packed bf16 is faster there
    ("avx512", torch.bfloat16, UPCAST_MIN_ROWS_ONEDNN - 1, False),
    ("avx512", torch.bfloat16, UPCAST_MIN_ROWS_ONEDNN, True),
    ("avx512_bf16", torch.bfloat16, 1024, False),
])
def test_which_path(monkeypatch, kind, dtype, rows, expected):
    as_cpu(monkeypatch, kind)
    w = torch.zeros(4, 8, dtype=dtype)
    assert linear.upcasts(torch.zeros(rows, 8, dtype=dtype), w) is expected
    assert linear.upcasts(torch.zeros(2, rows // 2 or 1, 8, dtype=dtype), w) is (expected and rows % 2 == 0)
    depends = dtype != torch.float32 and kind != "avx512_bf16"
    assert linear.path_switch_rows(w) == (linear.upcast_min_rows() if depends else None)
    with torch.no_grad():  # bf16 packs where oneDNN has bf16 GEMMs and the matmul does not upcast
        packs = linear.packs(torch.zeros(rows, 8, dtype=dtype), w)
    assert packs is (dtype == torch.float32 or (dtype == torch.bfloat16 and kind != "avx2" and not expected))


def test_gemv_rule_by_vendor():
    assert linear.gemv_rows_for(INTEL) == linear.MKL_GEMV_ROWS == 4
    for vendor in (AMD, "HygonGenuine", "unknown", ""):
        assert linear.gemv_rows_for(vendor) == 0
    with pytest.raises(TypeError, match="vendor"):
        linear.gemv_rows_for(None)
    # this machine: the rule its vendor gives, whichever vendor that is
    assert linear.mkl_gemv_rows() == linear.gemv_rows_for(linear.cpu_vendor())


@pytest.mark.parametrize("kind", sorted(CPU_CLASSES))
@pytest.mark.parametrize("vendor", [INTEL, AMD])
def test_fp32_path_by_vendor_and_rows(monkeypatch, kind, vendor):
    """fp32 takes F.linear below MKL_GEMV_ROWS rows on Intel CPUs and packs from there; on AMD it
    always packs. The bf16 rule is the same for both vendors."""
    as_cpu(monkeypatch, kind, vendor)
    w, bf = torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.bfloat16)
    switch = linear.MKL_GEMV_ROWS if vendor == INTEL else None
    assert linear.path_switch_rows(w) == switch
    with torch.no_grad():
        for rows in range(1, 9):
            assert linear.packs(torch.zeros(rows, 8), w) is (switch is None or rows >= switch)
            assert linear.packs(torch.zeros(1, rows, 8), w) is (switch is None or rows >= switch)
        as_cpu(monkeypatch, kind, AMD if vendor == INTEL else INTEL)
        other = [linear.packs(torch.zeros(rows, 8, dtype=torch.bfloat16), bf) for rows in (1, 16, 64)]
        as_cpu(monkeypatch, kind, vendor)
        assert [linear.packs(torch.zeros(rows, 8, dtype=torch.bfloat16), bf) for rows in (1, 16, 64)] == other


def test_native_half_cpu_never_upcasts(monkeypatch):
    monkeypatch.setattr(linear, "cpu_has_native_half", lambda: True)
    assert not linear.upcasts(torch.zeros(64, 8, dtype=torch.bfloat16),
                              torch.zeros(4, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize("kind", ["avx2", "avx512"])
@pytest.mark.parametrize("bias", [False, True])
def test_upcast_equals_fp32_math_rounded_to_bf16(monkeypatch, kind, bias):
    as_cpu(monkeypatch, kind)
    torch.manual_seed(1)
    layer = Linear(96, 48, bias=bias).to(torch.bfloat16)
    x = torch.randn(UPCAST_MIN_ROWS_ONEDNN, 96).to(torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16
    b = None if layer.bias is None else layer.bias.float()
    want = F.linear(x.float(), layer.weight.float(), b).to(torch.bfloat16)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    # ...and within one bf16 rounding of torch's own bf16 GEMM (which also accumulates in fp32)
    native = F.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(out.float(), native.float(), rtol=2 ** -7, atol=1e-2)


def fp32_tolerance(x: torch.Tensor, weight: torch.Tensor) -> float:
    """Reordered fp32 sums differ by rounding: a few ulps of the largest partial sum |x| . |w|."""
    partial = x.detach().abs().float() @ weight.detach().abs().float().T
    return 8 * torch.finfo(torch.float32).eps * float(partial.max())


@needs_onednn
@pytest.mark.parametrize("vendor", [INTEL, AMD])
@pytest.mark.parametrize("shape", [(1, 64), (3, 64), (16, 64), (2, 5, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_equals_f_linear(monkeypatch, vendor, shape, bias):
    """Both vendors' paths run here, whatever this CPU is: F.linear itself below the rule's rows
    (bit for bit), the packed GEMM from there (to rounding)."""
    as_vendor(monkeypatch, vendor)
    torch.manual_seed(0)
    layer = Linear(64, 300, bias=bias)
    x = torch.randn(shape)
    rows = x.numel() // 64
    with torch.no_grad():
        packs = linear.packs(x, layer.weight, layer.bias)
        assert packs is (vendor == AMD or rows >= linear.MKL_GEMV_ROWS)
        out = layer(x)
    assert out.shape == (*shape[:-1], 300)
    assert (layer.packed.weight is not None) is packs
    want = F.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(out, want, rtol=0, atol=fp32_tolerance(x, layer.weight) if packs else 0)


@needs_onednn
@pytest.mark.skipif(not linear.onednn_bf16(), reason="oneDNN has no bf16 GEMM on this CPU (AVX2): bf16 never "
                    "packs here, which test_which_path checks")
@pytest.mark.parametrize("bias", [False, True])
def test_packed_bf16_equals_f_linear_to_bf16_rounding(bias):
    torch.manual_seed(0)
    layer = Linear(96, 200, bias=bias).to(torch.bfloat16)
    x = torch.randn(2, 8, 96).to(torch.bfloat16)
    with torch.no_grad():
        assert linear.packs(x, layer.weight, layer.bias)
        out = layer(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), F.linear(x, layer.weight, layer.bias).float(), rtol=2 ** -7,
                               atol=1e-2)


def test_which_layers_pack(monkeypatch):
    as_cpu(monkeypatch, "avx2")
    w32, x32 = nn.Parameter(torch.zeros(4, 8)), torch.zeros(2, 8)
    bf = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert not linear.packs(x32, w32)  # grad enabled and the weight requires it: training
    with torch.no_grad():
        assert linear.packs(x32, w32)
        assert not linear.packs(bf[:2], bf)  # bf16 without any oneDNN bf16 GEMM (AVX2) keeps F.linear
        assert not linear.packs(x32.double(), w32)  # dtypes differ
        monkeypatch.setattr(linear, "cpu_has_native_half", lambda: True)
        assert linear.packs(bf[:2], bf)
        assert not linear.packs(x32.half(), w32.detach().half())  # fp16 never packs
    assert linear.packs(x32, w32.detach())  # grad enabled but nothing requires it
    assert not linear.packs(x32.requires_grad_(), w32.detach())
    monkeypatch.setattr(linear, "onednn_packed_gemm", lambda: False)
    with torch.no_grad():
        assert not linear.packs(torch.zeros(2, 8), w32)


def test_without_onednn_falls_back_to_f_linear(monkeypatch):
    monkeypatch.setattr(linear, "onednn_packed_gemm", lambda: False)
    torch.manual_seed(0)
    layer = Linear(64, 32, bias=True)
    x = torch.randn(3, 64)
    with torch.no_grad():
        out = layer(x)
        q, k = fused_linear(x, (layer, Linear(64, 16, bias=True)), PackedWeight())
    torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=0, atol=0)
    torch.testing.assert_close(q, out, rtol=0, atol=0)
    assert layer.packed.weight is None


def test_training_gets_gradients_through_f_linear():
    torch.manual_seed(0)
    layer = Linear(16, 8, bias=True)
    x = torch.randn(4, 16)
    layer(x).square().sum().backward()
    ref = nn.Linear(16, 8, bias=True)
    ref.load_state_dict(layer.state_dict())
    ref(x).square().sum().backward()
    torch.testing.assert_close(layer.weight.grad, ref.weight.grad, rtol=0, atol=0)
    torch.testing.assert_close(layer.bias.grad, ref.bias.grad, rtol=0, atol=0)
    assert layer.packed.weight is None


@needs_onednn
def test_repacks_when_the_weight_changes(count_packs):
    torch.manual_seed(0)
    layer = Linear(64, 300, bias=True)
    x = torch.randn(4, 64)
    tol = lambda: fp32_tolerance(x, layer.weight)  # noqa: E731
    with torch.no_grad():
        layer(x), layer(x)
        assert len(count_packs) == 1  # packed once, reused
        layer.weight.mul_(2)  # in place: the version counter moves
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=0, atol=tol())
        layer.bias.add_(1)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=0, atol=tol())
    other = nn.Linear(64, 300, bias=True)
    layer.load_state_dict(other.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(layer(x), other(x), rtol=0, atol=tol())
        layer.to(torch.float64).to(torch.float32)  # new tensors
        torch.testing.assert_close(layer(x), other(x), rtol=0, atol=tol())
    assert len(count_packs) == 5


@needs_onednn
def test_copies_leave_the_packed_weight_behind():
    import copy
    import pickle

    torch.manual_seed(0)
    layer = Linear(64, 300, bias=False)
    x = torch.randn(linear.MKL_GEMV_ROWS, 64)  # packs on every CPU
    with torch.no_grad():
        out = layer(x)  # packs: the opaque packed tensor cannot be deep-copied
        assert layer.packed.weight is not None
        for twin in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
            assert twin.packed.weight is None
            torch.testing.assert_close(twin(x), out, rtol=0, atol=0)
            twin.weight.mul_(2)
            torch.testing.assert_close(layer(x), out, rtol=0, atol=0)  # the original is untouched


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_fused_linear_equals_each_layer(bias, count_packs):
    torch.manual_seed(0)
    layers = [Linear(64, n, bias=bias) for n in (96, 32, 32)]
    packed = PackedWeight()
    x = torch.randn(2, 3, 64)
    with torch.no_grad():
        outs = fused_linear(x, layers, packed)
        fused_linear(x, layers, packed)
        assert len(count_packs) == 1 and count_packs[0] == (160, 64)  # one stacked weight, packed once
        for layer, out in zip(layers, outs):
            torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=0,
                                       atol=fp32_tolerance(x, layer.weight))
        layers[1].weight.mul_(-1)  # one member changes: the stack is repacked
        outs = fused_linear(x, layers, packed)
        torch.testing.assert_close(outs[1], F.linear(x, layers[1].weight, layers[1].bias), rtol=0,
                                   atol=fp32_tolerance(x, layers[1].weight))
    assert len(count_packs) == 2
    # with gradients needed, each layer runs on its own through F.linear
    outs = fused_linear(x, layers, packed)
    assert all(out.requires_grad for out in outs)
    assert len(count_packs) == 2


def test_a_forward_hook_on_a_fused_member_still_fires():
    """Notebooks record k_proj's output with a forward hook: fusion must not skip the member's call."""
    from radarlab.models.linear import Linear, PackedWeight, fused_linear

    layers = [Linear(8, 4, bias=False), Linear(8, 6, bias=False)]
    seen = []
    layers[1].register_forward_hook(lambda module, args, out: seen.append(out))
    with torch.no_grad():
        outs = fused_linear(torch.randn(3, 8), layers, PackedWeight())
    assert len(seen) == 1 and torch.equal(seen[0], outs[1])


# --- radarlab's GEMV at a few rows (with the C++ operators) ---------------------------------------
def _ops_or_skip():
    from radarlab.cpu_ops import cpu_ops_available, load_cpu_ops

    if not cpu_ops_available(warn=False):
        pytest.skip("radarlab's C++ operators do not build here")
    return load_cpu_ops()


@pytest.fixture
def count_gemv():
    """The row counts radarlab's GEMV was called with (wraps the operators' handle)."""
    ops = _ops_or_skip()

    class Counting:
        calls = []

        def gemv(self, x, weights, bias=None):
            self.calls.append(x.shape[0])
            return ops.gemv(x, weights, bias)

        def __getattr__(self, name):
            return getattr(ops, name)

    return Counting()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_a_few_rows_take_the_gemv_and_more_rows_do_not(dtype, bias, count_gemv):
    """With the operators, 1 to GEMV_MAX_ROWS rows (a [2, 2, K] input is 4 rows) take the GEMV on every
    CPU kind and vendor, equal to calling it directly; more rows, no operators, or gradients take the
    torch paths."""
    torch.manual_seed(0)
    layer = Linear(64, 40, bias=bias).to(dtype)
    with torch.no_grad():
        for shape in ((1, 64), (3, 64), (2, 2, 64)):
            x = torch.randn(shape).to(dtype)
            out = layer(x, count_gemv)
            want = count_gemv.gemv(x.reshape(-1, 64), [layer.weight], layer.bias).view(out.shape)
            assert torch.equal(out, want)
            b = None if layer.bias is None else layer.bias.float()
            torch.testing.assert_close(out.float(), F.linear(x.float(), layer.weight.float(), b),
                                       rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)
        assert count_gemv.calls == [1, 1, 3, 3, 4, 4]
        layer(torch.randn(linear.GEMV_MAX_ROWS + 1, 64).to(dtype), count_gemv)
        layer(torch.randn(2, 64).to(dtype))  # no operators given
    assert len(count_gemv.calls) == 6
    x = torch.randn(2, 64).to(dtype).requires_grad_()
    assert layer(x, count_gemv).requires_grad and len(count_gemv.calls) == 6  # autograd: F.linear


@pytest.mark.parametrize("bias", [False, True])
def test_fused_layers_take_one_gemv_on_their_weights_side_by_side(bias, count_gemv):
    torch.manual_seed(0)
    layers = [Linear(64, n, bias=bias) for n in (96, 32, 32)]
    x = torch.randn(2, 64)
    with torch.no_grad():
        outs = fused_linear(x, layers, PackedWeight(), count_gemv)
        assert count_gemv.calls == [2]  # one call for the three
        for layer, out in zip(layers, outs):
            torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
        mixed = [Linear(64, 8, bias=True), Linear(64, 8, bias=False)]  # biases must be all or none
        fused_linear(x, mixed, PackedWeight(), count_gemv)
        assert count_gemv.calls == [2, 2, 2]  # each on its own GEMV
        seen = []
        layers[1].register_forward_hook(lambda module, args, out: seen.append(out))
        outs = fused_linear(x, layers, PackedWeight(), count_gemv)  # a hook: each member is called
        assert len(seen) == 1 and torch.equal(seen[0], outs[1]) and count_gemv.calls == [2, 2, 2, 2, 2, 2]
