// SwiGLU's gate: out = silu(gate) * up in one pass, as vLLM's silu_and_mul.
//
// gate and up are the two halves of one fused GEMM's output (radarlab.models.linear.fused_linear),
// read in place through their row stride, in vectors (cpu_vec.h, its own exp). Rounding follows torch's two ops: silu in fp32 rounded to
// the model's dtype, then the product rounded again.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "cpu_common.h"
#include "cpu_vec.h"

namespace {
namespace vec = radarlab::vec;
using radarlab::round_to;
using radarlab::to_float;

at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up) {
  const int64_t n = gate.size(-1);
  radarlab::check_rows(gate, n, "silu_and_mul", "gate");
  radarlab::check_rows(up, n, "silu_and_mul", "up");
  TORCH_CHECK(up.size(0) == gate.size(0), "silu_and_mul: row counts differ");
  TORCH_CHECK(up.scalar_type() == gate.scalar_type(), "silu_and_mul: gate and up must share a dtype");
  at::Tensor out = gate.new_empty({gate.size(0), n});
  radarlab::dispatch_float(gate, "silu_and_mul", [&]<typename T>() {
    const T *g = gate.data_ptr<T>(), *u = up.data_ptr<T>();
    T* o = out.data_ptr<T>();
    const int64_t gs = gate.stride(0), us = up.stride(0), os = n;
    at::parallel_for(0, gate.size(0), 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T *gr = g + r * gs, *ur = u + r * us;
        T* orow = o + r * os;
        int64_t i = 0;
        for (; i + vec::N <= n; i += vec::N) {
          const vec::fvec a = vec::load(gr + i);
          const vec::fvec neg = vec::mul(a, vec::set(-1.f));
          const vec::fvec silu = vec::round_to<T>(vec::div(a, vec::add(vec::set(1.f), vec::exp(neg))));
          vec::store(orow + i, vec::mul(silu, vec::load(ur + i)));
        }
        for (; i < n; ++i) {
          const float a = to_float(gr[i]);
          orow[i] = static_cast<T>(round_to<T>(a / (1.f + std::exp(-a))) * to_float(ur[i]));
        }
      }
    });
  });
  return out;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(radarlab, m) { m.def("silu_and_mul(Tensor gate, Tensor up) -> Tensor"); }
TORCH_LIBRARY_IMPL(radarlab, CPU, m) { m.impl("silu_and_mul", &silu_and_mul); }
