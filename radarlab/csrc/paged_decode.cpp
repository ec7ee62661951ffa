// Paged decode attention on the CPU: one query token per sequence, K/V read in place from the blocks.
//
// The same algorithm as the Triton decode kernel of notebook 04 and as radarlab.attention.torch_paged,
// written for a CPU core: work items are sequences (or (sequence, KV head) pairs, see decode below),
// and at::parallel_for spreads them over torch's threads. An item walks the sequence's block table,
// so no padded copy of the batch's K/V is ever made, and 16-bit K/V rows are widened to fp32 as they
// are loaded, not as a whole gathered tensor. Scores, softmax and the weighted sum of V are fp32.
//
// The query heads that share a KV head (GQA) are handled together: each K and V row is loaded once
// for the whole group. At a batch large enough to keep every thread busy an item is a whole
// sequence, so each token's row (all KV heads side by side) is read front to back. Vectors are
// radarlab::vec's (cpu_vec.h): AVX-512 or AVX2, whichever the compiler was told the CPU has
// (-march=native), or plain loops on other CPUs; the same source is right on each.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <initializer_list>
#include <type_traits>
#include <vector>

#include "cpu_common.h"
#include "cpu_vec.h"

namespace {
using namespace radarlab::vec;
using radarlab::to_float;

struct Shape {
  int64_t num_seqs, num_kv_heads, group, head_dim, block_size, max_blocks;
  int64_t q_row_stride, q_head_stride;  // q may be a view of a fused qkv projection
};

// One work item: sequence s, KV heads h0 .. h0 + nh - 1, and their nh * group query heads.
// HD is head_dim when it is a multiple of N known at compile time (the loops over it unroll and
// K/V rows stay in registers); HD = 0 is any head_dim, read at run time, in scalar code.
// p = softmax(s) in place, in fp32, vectorized over the context.
inline void softmax(float* s, int64_t len) {
  int64_t t = 0;
  fvec mv = set(-INFINITY);
  for (; t + N <= len; t += N) mv = max(mv, load(s + t));
  float m = hmax(mv);
  for (; t < len; ++t) m = s[t] > m ? s[t] : m;
  fvec total = zero();
  float tail = 0.f;
  for (t = 0; t + N <= len; t += N) {
    const fvec e = radarlab::vec::exp(add(load(s + t), set(-m)));
    store(s + t, e);
    total = add(total, e);
  }
  for (; t < len; ++t) { s[t] = std::exp(s[t] - m); tail += s[t]; }
  const float inv = 1.f / (sum(total) + tail);
  for (t = 0; t + N <= len; t += N) store(s + t, mul(load(s + t), set(inv)));
  for (; t < len; ++t) s[t] *= inv;
}

template <typename Q, typename KV, int HD>
struct Item {
  const Shape& sh;
  const KV *k_cache, *v_cache;
  float scale;
  std::vector<float> qf, acc, scores;

  Item(const Shape& shape, const KV* k, const KV* v, float sc) : sh(shape), k_cache(k), v_cache(v), scale(sc) {}

  const KV* row(const KV* pool, const int32_t* table, int64_t t, int64_t h) const {  // token t's row of head h
    const int64_t token_stride = sh.num_kv_heads * sh.head_dim;
    return pool + (int64_t(table[t / sh.block_size]) * sh.block_size + t % sh.block_size) * token_stride +
           h * sh.head_dim;
  }

  // f(t, hh, row) for every token t of the context and every KV head hh of the item, token by token.
  template <typename F>
  void each_row(const KV* pool, const int32_t* table, int64_t len, int64_t h0, int64_t nh, F&& f) const {
    for (int64_t t = 0; t < len; ++t)
      for (int64_t hh = 0; hh < nh; ++hh) f(t, hh, row(pool, table, t, h0 + hh));
  }

  static void load_head(fvec* dst, const KV* p) {  // one head's K or V row, widened, in registers
    for (int i = 0; i < HD / N; ++i) dst[i] = load(p + i * N);
  }

  void run(Q* out, const Q* q, const int32_t* table, int64_t len, int64_t r, int64_t h0, int64_t nh) {
    const int64_t D = sh.head_dim, G = sh.group, heads = nh * G;
    qf.resize(heads * D);
    acc.assign(heads * D, 0.f);
    scores.resize(heads * len);
    for (int64_t j = 0; j < heads; ++j) {  // the item's queries, pre-scaled
      const Q* qh = q + r * sh.q_row_stride + (h0 * G + j) * sh.q_head_stride;
      for (int64_t d = 0; d < D; ++d) qf[j * D + d] = to_float(qh[d]) * scale;
    }
    // scores: token t's row holds every KV head's K side by side, so the item reads it front to back
    each_row(k_cache, table, len, h0, nh, [&](int64_t t, int64_t hh, const KV* k) {
      float* s = scores.data() + hh * G * len + t;  // the group's scores for token t, len apart
      if constexpr (HD > 0) {
        fvec kv[HD / N];
        load_head(kv, k);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + (hh * G + g) * HD;
          fvec s0 = zero(), s1 = zero();  // two chains: consecutive FMAs do not wait on each other
          for (int i = 0; i + 1 < HD / N; i += 2) {
            s0 = fma(load(qg + i * N), kv[i], s0);
            s1 = fma(load(qg + (i + 1) * N), kv[i + 1], s1);
          }
          if constexpr ((HD / N) % 2) s0 = fma(load(qg + (HD / N - 1) * N), kv[HD / N - 1], s0);
          s[g * len] = sum(add(s0, s1));
        }
      } else {
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + (hh * G + g) * D;
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * to_float(k[d]);
          s[g * len] = dot;
        }
      }
    });
    for (int64_t j = 0; j < heads; ++j) softmax(scores.data() + j * len, len);
    each_row(v_cache, table, len, h0, nh, [&](int64_t t, int64_t hh, const KV* v) {  // out = p V
      const float* p = scores.data() + hh * G * len + t;
      if constexpr (HD > 0) {
        fvec vv[HD / N];
        load_head(vv, v);
        for (int64_t g = 0; g < G; ++g) {
          const fvec pg = set(p[g * len]);
          float* a = acc.data() + (hh * G + g) * HD;
          for (int i = 0; i < HD / N; ++i) store(a + i * N, fma(pg, vv[i], load(a + i * N)));
        }
      } else {
        for (int64_t g = 0; g < G; ++g) {
          float* a = acc.data() + (hh * G + g) * D;
          for (int64_t d = 0; d < D; ++d) a[d] += p[g * len] * to_float(v[d]);
        }
      }
    });
    Q* o = out + (r * sh.num_kv_heads * G + h0 * G) * D;
    for (int64_t i = 0; i < heads * D; ++i) o[i] = static_cast<Q>(acc[i]);
  }
};

template <typename Q, typename KV, int HD>
void decode(Q* out, const Q* q, const KV* k_cache, const KV* v_cache, const int32_t* block_tables,
            const int32_t* seq_lens, const int64_t* rows, const Shape& sh, float scale) {
  // Enough sequences to keep every thread busy: one item per sequence, all its KV heads, so each
  // token row is read once, front to back. Fewer (batch 1): one item per (sequence, KV head).
  const int64_t per_item = sh.num_seqs >= 2 * at::get_num_threads() ? sh.num_kv_heads : 1;
  const int64_t chunks = sh.num_kv_heads / per_item;
  at::parallel_for(0, sh.num_seqs * chunks, 1, [&](int64_t begin, int64_t end) {
    Item<Q, KV, HD> item(sh, k_cache, v_cache, scale);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = i / chunks, h0 = (i % chunks) * per_item;
      item.run(out, q, block_tables + s * sh.max_blocks, seq_lens[s], rows ? rows[s] : s, h0, per_item);
    }
  });
}

template <typename Q, typename KV>
void launch(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& bt,
            const at::Tensor& lens, const int64_t* rows, const Shape& sh, float scale) {
  auto run = sh.head_dim == 64 ? decode<Q, KV, 64> : sh.head_dim == 128 ? decode<Q, KV, 128> : decode<Q, KV, 0>;
  static_assert(64 % N == 0 && 128 % N == 0);
  run(out.data_ptr<Q>(), q.data_ptr<Q>(), k.data_ptr<KV>(), v.data_ptr<KV>(), bt.data_ptr<int32_t>(),
      lens.data_ptr<int32_t>(), rows, sh, scale);
}

// out[rows[i]] = attention of q[rows[i]] over sequence i's context (rows absent: row i). The shapes
// and dtypes are checked here; that every block id and length is inside the pool is the caller's
// contract (radarlab.attention.layout validates block tables once per step).
void paged_decode(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, const c10::optional<at::Tensor>& rows,
                  double scale) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "paged_decode: k_cache and v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode: the pools must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_decode: k_cache and v_cache dtypes differ");
  TORCH_CHECK(q.dim() == 3 && q.size(2) == k_cache.size(3) && q.stride(2) == 1,
              "paged_decode: q must be [tokens, heads, head_dim] with contiguous head_dim matching the pool");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "paged_decode: query heads must be a multiple of KV heads");
  TORCH_CHECK(out.sizes() == q.sizes() && out.is_contiguous() && out.scalar_type() == q.scalar_type(),
              "paged_decode: out must be a contiguous tensor shaped and typed like q");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kInt && block_tables.is_contiguous(),
              "paged_decode: block_tables must be a contiguous int32 [num_seqs, max_blocks] tensor");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == block_tables.size(0) &&
              seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(),
              "paged_decode: seq_lens must be contiguous int32 with one entry per block-table row");
  const int64_t* row_ptr = nullptr;
  if (rows.has_value()) {
    TORCH_CHECK(rows->dim() == 1 && rows->size(0) == block_tables.size(0) && rows->scalar_type() == at::kLong &&
                rows->is_contiguous(), "paged_decode: rows must be contiguous int64 with one entry per sequence");
    row_ptr = rows->data_ptr<int64_t>();
  } else {
    TORCH_CHECK(q.size(0) == block_tables.size(0), "paged_decode: without rows, q needs one row per sequence");
  }
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &q, &k_cache, &v_cache, &block_tables, &seq_lens})
    TORCH_CHECK(t->device().is_cpu(), "paged_decode: every tensor must be on the CPU");
  const Shape sh{block_tables.size(0), k_cache.size(2), q.size(1) / k_cache.size(2), k_cache.size(3),
                 k_cache.size(1), block_tables.size(1), q.stride(0), q.stride(1)};
  const auto qt = q.scalar_type(), kt = k_cache.scalar_type();
  const float s = static_cast<float>(scale);
  if (qt == at::kFloat && kt == at::kFloat) launch<float, float>(out, q, k_cache, v_cache, block_tables, seq_lens, row_ptr, sh, s);
  else if (qt == at::kFloat && kt == at::kBFloat16) launch<float, c10::BFloat16>(out, q, k_cache, v_cache, block_tables, seq_lens, row_ptr, sh, s);
  else if (qt == at::kFloat && kt == at::kHalf) launch<float, c10::Half>(out, q, k_cache, v_cache, block_tables, seq_lens, row_ptr, sh, s);
  else if (qt == at::kBFloat16 && kt == at::kBFloat16) launch<c10::BFloat16, c10::BFloat16>(out, q, k_cache, v_cache, block_tables, seq_lens, row_ptr, sh, s);
  else if (qt == at::kHalf && kt == at::kHalf) launch<c10::Half, c10::Half>(out, q, k_cache, v_cache, block_tables, seq_lens, row_ptr, sh, s);
  else TORCH_CHECK(false, "paged_decode: q ", qt, " over a ", kt, " pool is not supported (fp32 q over an fp32, bf16 or fp16 pool, or q in the pool's 16-bit dtype)");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radarlab, m) {
  m.def("paged_decode(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor? rows, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(radarlab, CPU, m) { m.impl("paged_decode", &paged_decode); }
