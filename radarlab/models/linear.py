"""nn.Linear for CPU inference: oneDNN's GEMM on a weight packed once, and fp32 math for bf16/fp16
weights on CPUs without half-precision instructions.

Packed weights. A GEMM microkernel streams the weight in a blocked layout (tiles of the output
dimension, interleaved so one vector load feeds one FMA). F.linear hands oneDNN/MKL a plain
row-major weight, which is reordered into that layout on every call; oneDNN can instead reorder it
once (torch.ops.mkldnn._reorder_linear_weight) and multiply by the packed copy on every later call
(torch.ops.mkldnn._linear_pointwise), as vLLM's CPU backend does. Measured on an AVX-512 EPYC with 2
threads, per call, F.linear -> packed: fp32 [576 -> 3072] 95 -> 51 us at 1 row, 410 -> 133 us at 16,
1239 -> 484 us at 64; the fp32 LM head [576 -> 49152] 7.2 -> 2.9 ms at 1 row (MKL's packed GEMM took
4 ms), 15.3 -> 3.3 ms at 16; bf16 [576 -> 3072] 69 -> 36 us at 1 row, 116 -> 78 at 16, 281 -> 242 at 64.
The packed copy costs the weight's size once more. Its sums are ordered differently: fp32 results
differ from F.linear by ~1e-4 on N(0, 1) data; bf16 results came out identical.

The packed path runs only when nothing needs a gradient (training takes F.linear), for fp32 weights,
and for bf16 wherever oneDNN has bf16 GEMMs (below). The packed copy is remade when the weight is
replaced or written in place through autograd's version counter (load_state_dict, in-place ops under
no_grad, .to()); a write through `weight.data` bypasses that counter and is not seen.

bf16 on the three kinds of x86 CPU. With AVX512-BF16 or AMX, oneDNN multiplies bf16 natively and
bf16 always packs. With AVX-512F alone, oneDNN still has bf16 GEMMs (it widens the operands to fp32
inside its kernel): they pack, and beat F.linear's bf16 at small batches (measured with 2 threads,
1 row: [576 -> 3072] 164 -> 108 us, the LM head 4.8 -> 3.4 ms; 16 rows 1202 -> 1128 us). On an
AVX2-only CPU oneDNN has no bf16 GEMM and torch's is slow: a [64, 576] x [576, 1536] bf16 matmul took
11 ms against 2.4 ms in fp32 there, and vLLM's CPU build pays the same price.

Upcasting. Without bf16 instructions, converting both operands to fp32, multiplying, and rounding the
result back to bf16 gives the numbers a native bf16 GEMM gives (bf16 products are exact in fp32 and
GEMMs accumulate in fp32 anyway), so the model stays a bf16 model: bf16 weights in memory, bf16
activations between layers. Converting the weight costs the same at every call, so it pays only from
enough rows: 16 on AVX2, against torch's bf16 GEMM; 64 on AVX-512F, against oneDNN's packed bf16
(there 48 rows of [576 -> 3072] took 3.2 ms packed and 3.0 upcast, 64 rows 4.3 and 2.4).
upcast_min_rows() holds the rule. GPUs take the native path.

fp32 at a few rows on Intel CPUs. F.linear's fp32 matmul is Intel's MKL, which picks its kernels by
CPU vendor. On Intel CPUs its GEMV (one to three rows) beats the packed GEMM; from four rows, and at
any row count on AMD, the packed GEMM wins. Measured with 2 threads, F.linear against packed, per call:
on an Intel Xeon with AMX, 1 row, [576 -> 1536] 46 against 83 us, [1536 -> 576] 39 against 83 us,
the LM head 2.85 against 2.80 ms; 3 rows 44 against 89 us and 36 against 95 us; 4 rows 66 against
80 us and 72 against 93 us; on an Intel Xeon with AVX-512F a whole eager decode step at batch 1 went
from 44.1 to 33.7 ms; on an AMD EPYC, 1 row, [576 -> 3072] 95 against 51 us. mkl_gemv_rows() holds
the rule (by vendor, so it is the same on every run of one machine and can be tested for both here).

radarlab's GEMV at one to four rows. Where the caller passes radarlab's C++ operators (the model does
wherever they run), matmuls of at most GEMV_MAX_ROWS rows take torch.ops.radarlab.gemv (csrc/gemv.cpp)
instead of all of the above, on every CPU kind and vendor: at those rows a matmul streams its weight
once, and a kernel built for that, prefetching the next weight rows, streams it faster than the GEMM
libraries. Measured on an Intel Xeon with AMX, 2 threads, the course model's 121 matmuls of a decode
step in turn (weights from memory, not cache), packed -> gemv: bf16 1 row 15.3 -> 12.3 ms, 2 rows 16.3 ->
12.8, 3 rows 15.2 -> 13.7, 4 rows 15.9 -> 15.5; fp32 (against F.linear's MKL GEMV at 1-3 rows, packed at
4) 22.9 -> 22.5, 22.3 -> 20.7, 26.2 -> 24.0, 29.2 -> 24.6. Without the operators the rules above stand.
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from radarlab.device import cpu_vendor

UPCAST_MIN_ROWS = 16  # AVX2: below this torch's bf16 GEMM is as fast (measured: 1 row 0.36 ms vs 0.84 ms)
UPCAST_MIN_ROWS_ONEDNN = 64  # AVX-512F without bf16: below this oneDNN's packed bf16 is faster
MKL_GEMV_ROWS = 4  # Intel CPUs: fp32 matmuls of fewer rows take F.linear (MKL's GEMV)
GEMV_MAX_ROWS = 4  # matmuls of at most this many rows take radarlab's GEMV where the C++ operators run
# oneDNN picks the packed layout for an expected row count. In fp32, 64 was fastest at 1, 16 and 64
# rows alike (1 row: 59 us vs 79 us packed for 1; 16 rows: 132 us vs 208 us, on [576 -> 3072]); bf16
# did not care (within 5%).
PACK_BATCH_HINT = 64


@functools.cache
def cpu_has_native_half() -> bool:
    """True if this CPU has bf16 instructions torch uses (AVX512-BF16 or AMX)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    try:
        return any(getattr(torch.cpu, name)() for name in probes if hasattr(torch.cpu, name))
    except RuntimeError:
        return False


@functools.cache
def onednn_bf16() -> bool:
    """True if oneDNN has bf16 GEMMs on this CPU: native with AVX512-BF16 or AMX, widened to fp32 in
    its kernel with AVX-512F alone; False on AVX2."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def upcast_min_rows() -> int:
    """From how many rows a bf16 matmul runs in fp32, on a CPU without bf16 instructions."""
    return UPCAST_MIN_ROWS_ONEDNN if onednn_bf16() else UPCAST_MIN_ROWS


def gemv_rows_for(vendor: str) -> int:
    """Below how many rows an fp32 CPU matmul takes F.linear on a CPU of this vendor: MKL_GEMV_ROWS
    on Intel ("GenuineIntel"), 0 (never) elsewhere."""
    if not isinstance(vendor, str):
        raise TypeError(f"vendor must be a cpuinfo vendor_id string, got {type(vendor).__name__}")
    return MKL_GEMV_ROWS if vendor == "GenuineIntel" else 0


@functools.cache
def mkl_gemv_rows() -> int:
    """gemv_rows_for this CPU's vendor (read once)."""
    return gemv_rows_for(cpu_vendor())


@functools.cache
def onednn_packed_gemm() -> bool:
    """True if this torch build has oneDNN's packed-weight linear."""
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def packs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Does this matmul take oneDNN's packed path? A CPU inference matmul in fp32 (from
    mkl_gemv_rows() rows), or in bf16 where oneDNN has bf16 GEMMs and the matmul does not upcast."""
    if weight.device.type != "cpu" or x.dtype != weight.dtype:
        return False
    if weight.dtype == torch.bfloat16:
        if not (cpu_has_native_half() or (onednn_bf16() and not upcasts(x, weight))):
            return False
    elif weight.dtype != torch.float32 or x.numel() < mkl_gemv_rows() * x.shape[-1]:
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        return False  # the packed op has no backward
    return onednn_packed_gemm()


def upcasts(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Does this matmul take the fp32 path? Half-precision weights, on a CPU without half GEMMs,
    with enough rows to amortise converting the weight (upcast_min_rows)."""
    return (weight.dtype in (torch.bfloat16, torch.float16) and weight.device.type == "cpu"
            and not cpu_has_native_half() and x.numel() >= upcast_min_rows() * x.shape[-1])


def path_switch_rows(weight: torch.Tensor) -> int | None:
    """From how many rows this weight's matmul changes path (packed, upcast or F.linear), or None
    where the rows do not choose: half-precision weights on a CPU without bf16 instructions switch at
    upcast_min_rows(), fp32 on an Intel CPU at mkl_gemv_rows(). A replayed step picks per call."""
    if weight.device.type != "cpu":
        return None
    if weight.dtype in (torch.bfloat16, torch.float16) and not cpu_has_native_half():
        return upcast_min_rows()
    if weight.dtype == torch.float32 and mkl_gemv_rows() > 0:
        return mkl_gemv_rows()
    return None


def gemv_runs(x: torch.Tensor, layers: Sequence[nn.Linear]) -> bool:
    """Do these layers, applied to x, take radarlab's GEMV (given its C++ operators)? A CPU inference
    matmul of 1 to GEMV_MAX_ROWS rows in fp32, bf16 or fp16, every weight contiguous in x's dtype, and
    biases all present or all absent."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16) or x.device.type != "cpu":
        return False
    if not 1 <= x.numel() <= GEMV_MAX_ROWS * x.shape[-1]:
        return False
    if len({layer.bias is None for layer in layers}) > 1:
        return False
    if any(layer.weight.dtype != x.dtype or not layer.weight.is_contiguous() for layer in layers):
        return False
    grads = torch.is_grad_enabled() and (x.requires_grad or any(
        p.requires_grad for layer in layers for p in (layer.weight, layer.bias) if p is not None))
    return not grads  # the GEMV has no backward


def gemv(x: torch.Tensor, layers: Sequence[nn.Linear], ops) -> torch.Tensor:
    """x times the layers' weights side by side (plus biases), through radarlab's GEMV: [..., sum N]."""
    bias = None if layers[0].bias is None else torch.cat([layer.bias for layer in layers])
    out = ops.gemv(x.reshape(-1, x.shape[-1]).contiguous(), [layer.weight for layer in layers], bias)
    return out.view(*x.shape[:-1], out.shape[-1])


def _fingerprint(t: torch.Tensor | None):
    if t is None:
        return None
    # Inference tensors have no version counter (they cannot be written outside inference mode).
    version = -1 if t.is_inference() else t._version
    return t.data_ptr(), version, t.dtype, tuple(t.shape)


class PackedWeight:
    """oneDNN's packed copy of one weight, or of several stacked along the output dimension, with
    their bias; remade when any of them changes. Copies and pickles leave the packed tensor behind
    (it is opaque and cannot be copied); the copy packs its own on first use."""

    def __init__(self) -> None:
        self.key, self.weight, self.bias = None, None, None

    def __getstate__(self) -> dict:
        return {"key": None, "weight": None, "bias": None}

    def get(self, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]):
        """(packed weight, bias or None) for these weights stacked in order."""
        key = tuple(_fingerprint(t) for t in (*weights, *biases))
        if key != self.key:
            self.key, self.weight, self.bias = None, None, None  # free the old copy before packing
            w = weights[0] if len(weights) == 1 else torch.cat(weights)
            self.weight = torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_BATCH_HINT)
            if biases[0] is not None:
                self.bias = (biases[0] if len(biases) == 1 else torch.cat(biases)).detach()
            self.key = key
        return self.weight, self.bias

    def linear(self, x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]):
        """x times the stacked weights (plus bias), through the packed copy."""
        weight, bias = self.get(weights, biases)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class Linear(nn.Linear):
    """Same parameters and state dict as nn.Linear; see the module docstring for the CPU paths."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.packed = PackedWeight()

    def forward(self, x: torch.Tensor, ops=None) -> torch.Tensor:
        """ops: radarlab's C++ operators (torch.ops.radarlab), for the GEMV at a few rows; None for
        torch's matmuls alone."""
        if ops is not None and gemv_runs(x, (self,)):
            return gemv(x, (self,), ops)
        if packs(x, self.weight, self.bias):
            return self.packed.linear(x, [self.weight], [self.bias])
        if upcasts(x, self.weight):
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)
        return F.linear(x, self.weight, self.bias)


def fused_linear(x: torch.Tensor, layers: Sequence[Linear], packed: PackedWeight,
                 ops=None) -> tuple[torch.Tensor, ...]:
    """Each layer applied to the same x (q/k/v, gate/up), as one matmul on their weights side by side:
    radarlab's GEMV at a few rows where ops (its C++ operators) are given, else one packed GEMM on their
    stacked weights where the packed path runs; `packed` (kept by the parent module) holds that copy. The
    layers keep their own parameters, so state dicts and module names do not change. One GEMM with
    a wider output beats several: measured with packed weights, fp32 q/k/v [576 -> 576/192/192]
    56 -> 34 us at 1 row and 88 -> 65 us at 16; gate/up [576 -> 2 x 1536] 70 -> 60 us at 1 row."""
    hooked = any(layer._forward_hooks or layer._forward_pre_hooks for layer in layers)
    if ops is not None and not hooked and gemv_runs(x, layers):
        return gemv(x, layers, ops).split([layer.out_features for layer in layers], dim=-1)
    if not packed_path(x, layers):
        return tuple(layer(x, ops) for layer in layers)
    out = packed.linear(x, [layer.weight for layer in layers], [layer.bias for layer in layers])
    return out.split([layer.out_features for layer in layers], dim=-1)


def packed_path(x: torch.Tensor, layers: Sequence[Linear], check_hooks: bool = True) -> bool:
    """Do these layers, applied to x, run as one packed GEMM on their stacked weights? Every weight
    packs, their biases are all present or all absent, and (check_hooks) no layer has a hook, which
    must see each call (the replayed step checks hooks per step instead)."""
    if check_hooks and any(layer._forward_hooks or layer._forward_pre_hooks for layer in layers):
        return False
    if len({layer.bias is None for layer in layers}) > 1:
        return False
    return all(packs(x, layer.weight, layer.bias) for layer in layers)
