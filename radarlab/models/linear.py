"""nn.Linear whose bf16/fp16 matmuls run in fp32 on CPUs without half-precision instructions, and
an LM head that reads its weight through MKL's packed GEMM when it computes one row.

On an AVX2-only CPU (no AVX512-BF16, no AMX) torch has no fast bf16 GEMM: measured here, a
[64, 576] x [576, 1536] bf16 matmul takes 11 ms against 2.4 ms in fp32, and vLLM's CPU build pays
the same price. Upcasting both operands to fp32, multiplying, and rounding the result back to bf16
gives the numbers a native bf16 GEMM gives (bf16 products are exact in fp32 and GEMMs accumulate
in fp32 anyway), so the model stays a bf16 model: bf16 weights in memory, bf16 activations between
layers. For a few rows the weight conversion costs more than it saves, so small batches keep the
native path. GPUs and bf16-capable CPUs always take the native path.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

UPCAST_MIN_ROWS = 16  # below this the native bf16 GEMM is as fast (measured: 1 row 0.36 ms vs 0.84 ms)


@functools.cache
def cpu_has_native_half() -> bool:
    """True if this CPU has bf16 instructions torch uses (AVX512-BF16 or AMX)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    try:
        return any(getattr(torch.cpu, name)() for name in probes if hasattr(torch.cpu, name))
    except RuntimeError:
        return False


def upcasts(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Does this matmul take the fp32 path? Half-precision weights, on a CPU without half GEMMs,
    with enough rows to amortise converting the weight."""
    return (weight.dtype in (torch.bfloat16, torch.float16) and weight.device.type == "cpu"
            and x.numel() >= UPCAST_MIN_ROWS * x.shape[-1] and not cpu_has_native_half())


class Linear(nn.Linear):
    """Same parameters and state dict as nn.Linear; see the module docstring for the CPU path."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not upcasts(x, self.weight):
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)


@functools.cache
def mkl_packed_gemm() -> bool:
    """True if this torch build has MKL's packed-weight GEMM (torch.ops.mkl._mkl_linear)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


class PackedRowLinear(Linear):
    """The LM head: at one row (a batch-1 decode step) in fp32 on a CPU, it multiplies through MKL's
    packed-weight GEMM. torch's default path for one row is a GEMV that streams the 49152 x 576
    weight at about half the speed (measured: 26 ms against 13 ms per call on one loaded core of
    this course's machine), and at batch 1 the LM head is a sixth of the step. The packed copy is
    made on first use, kept while the weight is unchanged, and costs the weight's size once more.
    Its sums are ordered differently: logits differ from F.linear by ~1e-4 (fp32 rounding)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.dim() == 2 and x.shape[0] == 1 and w.dtype == torch.float32 and w.device.type == "cpu" \
                and mkl_packed_gemm():
            return torch.ops.mkl._mkl_linear(x, self._packed(), w, self.bias, 1)
        return super().forward(x)

    def __getstate__(self):
        """Copies and pickles leave the packed weight behind: MKL's packed tensor is opaque (it cannot
        be deep-copied), and the copy packs its own on first use."""
        state = dict(super().__getstate__())
        state.pop("_packed_cache", None)
        return state

    def _packed(self) -> torch.Tensor:
        key = (self.weight.data_ptr(), self.weight._version)
        cached = getattr(self, "_packed_cache", None)
        if cached is None or cached[0] != key:
            cached = (key, torch.ops.mkl._mkl_reorder_linear_weight(self.weight.detach(), 1))
            self._packed_cache = cached
        return cached[1]
