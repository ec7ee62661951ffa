// A matmul of a few rows (decode at small batches): y = x W^T for x [rows, K] and one or more row-major
// weights [N_i, K] side by side (q/k/v, gate/up), as one output [rows, sum N_i].
//
// Why its own kernel. At one to four rows a matmul reads each weight element once and does one or a
// few multiply-adds with it: its speed is the speed weights stream from memory. A GEMM library's
// kernels are built for the opposite case (many rows, weights reused from cache) and leave bandwidth
// unused here. This reads each weight row once, for all rows of x at a time, with the next block of
// weight rows prefetched while the current one is summed. Sums are in fp32 (bf16 and fp16 products
// are exact there), rounded once to the output dtype, as a GEMM of those dtypes does; their order
// differs from a library's, so results can differ by an ulp of fp32 sums.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "cpu_common.h"
#include "cpu_vec.h"

namespace {
namespace vec = radarlab::vec;
using radarlab::to_float;

constexpr int64_t MAX_ROWS = 4;  // radarlab.models.linear.GEMV_MAX_ROWS
// Vectors summed at once, R rows of x times B weight rows: half the vector registers (32 with AVX-512,
// 16 with AVX2), the rest holding x and the weight vector; B at most 8.
constexpr int ACCUMULATORS = vec::N == 16 ? 16 : 8;
template <int R> constexpr int block_of() { return std::max(1, std::min(8, ACCUMULATORS / R)); }
constexpr int LINE = 64;         // bytes of a cache line: one prefetch each

struct Weight {
  const void* data;
  int64_t n;      // output features
  int64_t col0;   // first column of the output it fills
  int64_t block0; // first block (of B weight rows) in the global numbering that spreads work over threads
};

// Outputs [n0, n0 + m) of one weight, for all R rows of x. FULL: m == B, and the next B weight rows
// exist and are fetched while these are summed, a cache line per load. Else the weight's last block.
template <typename T, int R, int B, bool FULL>
void block_rows(const T* x, const T* w, int64_t K, int64_t n0, int m, T* y, int64_t ldy, const T* bias) {
  if constexpr (FULL) m = B;
  constexpr int per_line = LINE / sizeof(T);
  vec::fvec acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < B; ++j) acc[r][j] = vec::zero();
  int64_t k = 0;
  for (; k + vec::N <= K; k += vec::N) {
    vec::fvec xv[R];
    for (int r = 0; r < R; ++r) xv[r] = vec::load(x + r * K + k);
#pragma GCC unroll 8
    for (int j = 0; j < B; ++j) {
      if (!FULL && j >= m) break;
      if (FULL && k % per_line == 0) __builtin_prefetch(w + (n0 + B + j) * K + k, 0, 3);
      const vec::fvec wv = vec::load(w + (n0 + j) * K + k);
      for (int r = 0; r < R; ++r) acc[r][j] = vec::fma(xv[r], wv, acc[r][j]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < m; ++j) {
      float s = vec::sum(acc[r][j]);
      for (int64_t t = k; t < K; ++t) s += to_float(x[r * K + t]) * to_float(w[(n0 + j) * K + t]);
      if (bias != nullptr) s += to_float(bias[n0 + j]);
      y[r * ldy + n0 + j] = static_cast<T>(s);
    }
}

template <typename T, int R>
void run(const T* x, const std::vector<Weight>& weights, int64_t K, int64_t blocks, T* y, int64_t ldy,
         const T* bias) {
  constexpr int B = block_of<R>();
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    size_t i = 0;
    for (int64_t b = begin; b < end; ++b) {
      while (b >= weights[i].block0 + (weights[i].n + B - 1) / B) ++i;
      const Weight& wt = weights[i];
      const int64_t n0 = (b - wt.block0) * B;
      const T* w = static_cast<const T*>(wt.data);
      const T* bias_i = bias == nullptr ? nullptr : bias + wt.col0;
      if (n0 + 2 * B <= wt.n)  // a full block with a full block after it
        block_rows<T, R, B, true>(x, w, K, n0, B, y + wt.col0, ldy, bias_i);
      else
        block_rows<T, R, B, false>(x, w, K, n0, static_cast<int>(std::min<int64_t>(B, wt.n - n0)), y + wt.col0,
                                   ldy, bias_i);
    }
  });
}

template <int R>
int64_t count_blocks(std::vector<Weight>& weights) {
  constexpr int B = block_of<R>();
  int64_t blocks = 0;
  for (Weight& w : weights) {
    w.block0 = blocks;
    blocks += (w.n + B - 1) / B;
  }
  return blocks;
}

template <typename T, int R>
void gemv_rows(const at::Tensor& x, std::vector<Weight> weights, at::Tensor& y, const T* bias) {
  const int64_t blocks = count_blocks<R>(weights);
  run<T, R>(x.data_ptr<T>(), weights, x.size(1), blocks, y.data_ptr<T>(), y.size(1), bias);
}

at::Tensor gemv(const at::Tensor& x, at::TensorList weights, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(),
              "gemv: x must be a contiguous [rows, K] CPU tensor, got sizes ", x.sizes(), " strides ", x.strides());
  const int64_t rows = x.size(0), K = x.size(1);
  TORCH_CHECK(rows >= 1 && rows <= MAX_ROWS, "gemv: x must have 1 to ", MAX_ROWS, " rows, got ", rows);
  TORCH_CHECK(!weights.empty(), "gemv: no weights");
  std::vector<Weight> ws;
  int64_t cols = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.size(1) == K && w.is_contiguous(),
                "gemv: weight ", i, " must be a contiguous [N, ", K, "] CPU tensor, got sizes ", w.sizes(),
                " strides ", w.strides());
    TORCH_CHECK(w.scalar_type() == x.scalar_type(), "gemv: weight ", i, " is ", w.scalar_type(), ", x is ",
                x.scalar_type());
    ws.push_back({w.data_ptr(), w.size(0), cols, 0});
    cols += w.size(0);
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->device().is_cpu() && bias->dim() == 1 && bias->size(0) == cols && bias->is_contiguous() &&
                    bias->scalar_type() == x.scalar_type(),
                "gemv: bias must be a contiguous [", cols, "] ", x.scalar_type(), " CPU tensor, got sizes ",
                bias->sizes(), " dtype ", bias->scalar_type());
  }
  at::Tensor y = x.new_empty({rows, cols});
  radarlab::dispatch_float(x, "gemv", [&]<typename T>() {
    const T* b = bias.has_value() ? bias->data_ptr<T>() : nullptr;
    switch (rows) {
      case 1: gemv_rows<T, 1>(x, ws, y, b); break;
      case 2: gemv_rows<T, 2>(x, ws, y, b); break;
      case 3: gemv_rows<T, 3>(x, ws, y, b); break;
      default: gemv_rows<T, 4>(x, ws, y, b); break;
    }
  });
  return y;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(radarlab, m) { m.def("gemv(Tensor x, Tensor[] weights, Tensor? bias=None) -> Tensor"); }
TORCH_LIBRARY_IMPL(radarlab, CPU, m) { m.impl("gemv", &gemv); }
