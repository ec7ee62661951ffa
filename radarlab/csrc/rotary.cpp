// Rotary position embedding applied in place to q and k, as vLLM's rotary_embedding.
//
// The torch code (radarlab.models.llama.apply_rope) builds the rotated copy with cat and neg and
// runs four more ops, for q and again for k. Here each token's heads are rotated where they lie (q
// and k are views of the fused qkv GEMM's output). Pairs are (i, i + D/2), the layout of Llama's
// checkpoints in transformers. Rounding follows the torch code: each product rounded to the model's
// dtype, then their sum.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_common.h"
#include "cpu_vec.h"

namespace {
namespace vec = radarlab::vec;
using radarlab::round_to;
using radarlab::to_float;

template <typename T>
void rotate_heads(T* x, int64_t heads, int64_t head_stride, int64_t half, const T* c, const T* s) {
  for (int64_t h = 0; h < heads; ++h) {
    T* v = x + h * head_stride;
    int64_t i = 0;
    for (; i + vec::N <= half; i += vec::N) {
      const vec::fvec a = vec::load(v + i), b = vec::load(v + i + half);
      const vec::fvec c1 = vec::load(c + i), c2 = vec::load(c + i + half);
      const vec::fvec s1 = vec::load(s + i), s2 = vec::load(s + i + half);
      const vec::fvec minus_b = vec::mul(b, vec::set(-1.f));
      vec::store(v + i, vec::add(vec::round_to<T>(vec::mul(a, c1)), vec::round_to<T>(vec::mul(minus_b, s1))));
      vec::store(v + i + half, vec::add(vec::round_to<T>(vec::mul(b, c2)), vec::round_to<T>(vec::mul(a, s2))));
    }
    for (; i < half; ++i) {
      const float a = to_float(v[i]), b = to_float(v[i + half]);
      // cos and sin repeat over the two halves (emb = cat(freqs, freqs)), so c[i] and c[i + half] are equal
      v[i] = static_cast<T>(round_to<T>(a * to_float(c[i])) + round_to<T>(-b * to_float(s[i])));
      v[i + half] = static_cast<T>(round_to<T>(b * to_float(c[i + half])) + round_to<T>(a * to_float(s[i + half])));
    }
  }
}

void rotary_embedding(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t d = cos.size(-1), tokens = cos.size(0);
  TORCH_CHECK(d % 2 == 0, "rotary_embedding: head_dim must be even, got ", d);
  TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && sin.sizes() == cos.sizes() && sin.is_contiguous(),
              "rotary_embedding: cos and sin must be contiguous [tokens, head_dim]");
  for (const at::Tensor* t : {&q, &k}) {
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 3 && t->size(0) == tokens && t->size(2) == d && t->stride(2) == 1,
                "rotary_embedding: q and k must be CPU [tokens, heads, head_dim] with a contiguous head_dim, got ",
                t->sizes());
    TORCH_CHECK(t->scalar_type() == cos.scalar_type() && sin.scalar_type() == cos.scalar_type(),
                "rotary_embedding: q, k, cos and sin must share a dtype");
  }
  radarlab::dispatch_float(q, "rotary_embedding", [&]<typename T>() {
    const T *c = cos.data_ptr<T>(), *s = sin.data_ptr<T>();
    T *qp = q.data_ptr<T>(), *kp = k.data_ptr<T>();
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        rotate_heads(qp + t * q.stride(0), q.size(1), q.stride(1), d / 2, c + t * d, s + t * d);
        rotate_heads(kp + t * k.stride(0), k.size(1), k.stride(1), d / 2, c + t * d, s + t * d);
      }
    });
  });
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(radarlab, m) { m.def("rotary_embedding(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()"); }
TORCH_LIBRARY_IMPL(radarlab, CPU, m) { m.impl("rotary_embedding", &rotary_embedding); }
