// Greedy decoding's token: the index of each row's largest logit, as torch.argmax(-1) gives it (the
// first of equal maxima; a NaN counts as the largest, the first NaN wins).
//
// Why its own kernel. At batch 64 the logits are [64, vocab] in the model's dtype; torch's CPU argmax
// over bf16 rows is slow, and widening them to fp32 first costs a copy of the whole block. This reads
// the rows once, in place, in vectors: each lane keeps its largest value and where it was (indices
// are exact as floats below 2^24), and the lanes are merged at the end.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

#include "cpu_common.h"
#include "cpu_vec.h"

namespace {
namespace vec = radarlab::vec;
using radarlab::to_float;

constexpr int64_t MAX_EXACT_INDEX = int64_t(1) << 24;  // every index below is exact as an fp32 lane value

template <typename T>
int64_t argmax_row(const T* row, int64_t n) {
  float lane_iota[vec::N];
  for (int i = 0; i < vec::N; ++i) lane_iota[i] = static_cast<float>(i);
  const vec::fvec iota = vec::load(lane_iota);
  vec::fvec best = vec::set(-std::numeric_limits<float>::infinity()), where = vec::zero();
  vec::fvec nan_seen = vec::zero();
  int64_t i = 0;
  for (; i + vec::N <= n; i += vec::N) {
    const vec::fvec v = vec::load(row + i);
    where = vec::where_greater(v, best, vec::add(vec::set(static_cast<float>(i)), iota), where);
    best = vec::where_greater(v, best, v, best);
    nan_seen = vec::where_nan(v, vec::set(1.f), nan_seen);
  }
  if (vec::hmax(nan_seen) > 0.f) {  // a NaN in the vectors: the first NaN wins
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(to_float(row[j]))) return j;
  }
  float lanes_best[vec::N], lanes_where[vec::N];
  vec::store(lanes_best, best);
  vec::store(lanes_where, where);
  float top = -std::numeric_limits<float>::infinity();
  int64_t at = 0;  // a row of -inf only: index 0, as torch
  for (int l = 0; l < vec::N && i > 0; ++l) {
    const int64_t idx = static_cast<int64_t>(lanes_where[l]);
    if (lanes_best[l] > top || (lanes_best[l] == top && idx < at)) top = lanes_best[l], at = idx;
  }
  for (; i < n; ++i) {  // the tail, after every vector (so later in the row than any lane's index)
    const float v = to_float(row[i]);
    if (std::isnan(v)) return i;
    if (v > top) top = v, at = i;
  }
  return at;
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.stride(1) == 1,
              "argmax_rows: logits must be a [rows, vocab] CPU tensor with a contiguous last dimension, got sizes ",
              logits.sizes(), " strides ", logits.strides());
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(n >= 1 && n < MAX_EXACT_INDEX, "argmax_rows: the vocabulary must have 1 to ", MAX_EXACT_INDEX - 1,
              " entries, got ", n);
  at::Tensor out = logits.new_empty({rows}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  radarlab::dispatch_float(logits, "argmax_rows", [&]<typename T>() {
    const T* p = logits.data_ptr<T>();
    const int64_t stride = logits.stride(0);
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(p + r * stride, n);
    });
  });
  return out;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(radarlab, m) { m.def("argmax_rows(Tensor logits) -> Tensor"); }
TORCH_LIBRARY_IMPL(radarlab, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
