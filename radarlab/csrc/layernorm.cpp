// RMSNorm in one pass per row: y = weight * (x / sqrt(mean(x^2) + eps)), as vLLM's rms_norm.
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

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t n = weight.numel();
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be a contiguous 1-D tensor of x's dtype");
  radarlab::check_rows(x, n, "rms_norm", "x");
  radarlab::check_rows(out, n, "rms_norm", "out");
  TORCH_CHECK(out.size(0) == x.size(0) && out.scalar_type() == x.scalar_type(), "rms_norm: out must match x");
  radarlab::dispatch_float(x, "rms_norm", [&]<typename T>() {
    const T* xp = x.data_ptr<T>();
    const T* w = weight.data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t xs = x.stride(0), os = out.stride(0);
    at::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* row = xp + r * xs;
        T* o = op + r * os;
        vec::fvec acc = vec::zero();
        int64_t i = 0;
        for (; i + vec::N <= n; i += vec::N) { const vec::fvec v = vec::load(row + i); acc = vec::fma(v, v, acc); }
        float ss = vec::sum(acc);
        for (int64_t j = i; j < n; ++j) { const float v = to_float(row[j]); ss += v * v; }
        const float inv = 1.f / std::sqrt(ss / float(n) + float(eps));
        const vec::fvec iv = vec::set(inv);
        for (i = 0; i + vec::N <= n; i += vec::N)
          vec::store(o + i, vec::mul(vec::load(w + i), vec::round_to<T>(vec::mul(vec::load(row + i), iv))));
        for (; i < n; ++i) o[i] = static_cast<T>(to_float(w[i]) * round_to<T>(to_float(row[i]) * inv));
      }
    });
  });
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(radarlab, m) { m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()"); }
TORCH_LIBRARY_IMPL(radarlab, CPU, m) { m.impl("rms_norm", &rms_norm); }
