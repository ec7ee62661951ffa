// RMSNorm in one pass per row: y = weight * (x / sqrt(mean(x^2) + eps)), as vLLM's rms_norm, and
// with the residual add before it, as vLLM's fused_add_rms_norm.
//
// The torch code (radarlab.models.llama.RMSNorm) runs eight ops per call, each a dispatch and a pass
// over the activations. Here each row is summed and scaled by one thread, in vectors (cpu_vec.h). Rounding follows the torch
// code exactly: the sum and the normalized x in fp32, x/rms rounded to the model's dtype, then the
// product with the weight rounded again (transformers' LlamaRMSNorm does the same).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>

#include "cpu_common.h"
#include "cpu_vec.h"

namespace {
namespace vec = radarlab::vec;
using radarlab::round_to;
using radarlab::to_float;

// One row: out = weight * round(x / rms(x)), summed in vectors.
template <typename T>
void norm_row(T* o, const T* row, const T* w, int64_t n, float eps) {
  vec::fvec acc = vec::zero();
  int64_t i = 0;
  for (; i + vec::N <= n; i += vec::N) { const vec::fvec v = vec::load(row + i); acc = vec::fma(v, v, acc); }
  float ss = vec::sum(acc);
  for (int64_t j = i; j < n; ++j) { const float v = to_float(row[j]); ss += v * v; }
  const float inv = 1.f / std::sqrt(ss / float(n) + eps);
  const vec::fvec iv = vec::set(inv);
  for (i = 0; i + vec::N <= n; i += vec::N)
    vec::store(o + i, vec::mul(vec::load(w + i), vec::round_to<T>(vec::mul(vec::load(row + i), iv))));
  for (; i < n; ++i) o[i] = static_cast<T>(to_float(w[i]) * round_to<T>(to_float(row[i]) * inv));
}

void check(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.scalar_type() == x.scalar_type(), op,
              ": weight must be a contiguous 1-D tensor of x's dtype");
  radarlab::check_rows(x, weight.numel(), op, "x");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x, weight, "rms_norm");
  const int64_t n = weight.numel();
  at::Tensor out = x.new_empty({x.size(0), n});
  radarlab::dispatch_float(x, "rms_norm", [&]<typename T>() {
    const T *xp = x.data_ptr<T>(), *w = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) norm_row(op + r * n, xp + r * x.stride(0), w, n, float(eps));
    });
  });
  return out;
}

// The residual stream and the next norm in one pass, as vLLM's fused_add_rms_norm: x += delta in
// place (rounded to x's dtype, as torch's add), then out = rms_norm(x).
at::Tensor add_rms_norm(at::Tensor x, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  check(x, weight, "add_rms_norm");
  radarlab::check_rows(delta, weight.numel(), "add_rms_norm", "delta");
  TORCH_CHECK(delta.size(0) == x.size(0) && delta.scalar_type() == x.scalar_type(),
              "add_rms_norm: delta must match x");
  const int64_t n = weight.numel();
  at::Tensor out = x.new_empty({x.size(0), n});
  radarlab::dispatch_float(x, "add_rms_norm", [&]<typename T>() {
    T* xp = x.data_ptr<T>();
    const T *dp = delta.data_ptr<T>(), *w = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        T* row = xp + r * x.stride(0);
        const T* d = dp + r * delta.stride(0);
        int64_t i = 0;
        for (; i + vec::N <= n; i += vec::N) vec::store(row + i, vec::add(vec::load(row + i), vec::load(d + i)));
        for (; i < n; ++i) row[i] = static_cast<T>(to_float(row[i]) + to_float(d[i]));
        norm_row(op + r * n, row, w, n, float(eps));
      }
    });
  });
  return out;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(radarlab, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor");
}
TORCH_LIBRARY_IMPL(radarlab, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}
