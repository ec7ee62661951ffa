// What the C++ operators share besides vectors (cpu_vec.h): scalar 16-bit <-> fp32 conversions that
// round as torch rounds (for the tails of rows), dtype dispatch and argument checks.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace radarlab {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// An fp32 value rounded to T (round to nearest even, as torch stores each op's result) and read back.
template <typename T> inline float round_to(float x) { return to_float(static_cast<T>(x)); }
template <> inline float round_to<float>(float x) { return x; }

// Calls f.template operator()<T>() for the tensor's dtype: fp32, bf16 or fp16.
template <typename F> void dispatch_float(const at::Tensor& t, const char* op, F&& f) {
  switch (t.scalar_type()) {
    case at::kFloat: f.template operator()<float>(); break;
    case at::kBFloat16: f.template operator()<c10::BFloat16>(); break;
    case at::kHalf: f.template operator()<c10::Half>(); break;
    default: TORCH_CHECK(false, op, ": expected float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

// [rows, n] with a contiguous last dimension and any row stride (a view of a fused GEMM's output).
inline void check_rows(const at::Tensor& t, int64_t n, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be on the CPU");
  TORCH_CHECK(t.dim() == 2 && t.size(1) == n && t.stride(1) == 1, op, ": ", name, " must be [rows, ", n,
              "] with a contiguous last dimension, got sizes ", t.sizes(), " strides ", t.strides());
}

}  // namespace radarlab
